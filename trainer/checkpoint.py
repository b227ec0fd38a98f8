"""Crash-safe checkpoints in <run dir>/checkpoints/step-<N>/.

A checkpoint is written into a temporary sibling directory, every file flushed to disk, the directory
renamed into place, and only then the COMPLETE marker (listing every file and its size) is written. A
directory without a valid marker is incomplete and never resumed from; older checkpoints are deleted only
after a newer one is complete, so a crash at any moment leaves the previous checkpoint usable.

Contents: the trainable weights (LoRA: peft's adapter format in adapter/, loadable with
peft.PeftModel.from_pretrained; full fine-tuning: model.safetensors), optimizer.pt, trainer_state.pt (LR
scheduler, RNG states, data-pipeline state), progress.json (step, tokens seen, skipped steps, W&B run id)
and config.yaml (the resolved config of the run).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from model import unwrap_llama

log = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
ADAPTER_DIR = "adapter"
FULL_WEIGHTS = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.pt"
PROGRESS_FILE = "progress.json"
CONFIG_FILE = "config.yaml"
# In the run directory, not per checkpoint: the random-init base of a LoRA run, kept once for export.
BASE_MODEL_DIR = "base_model"
STEP_PREFIX = "step-"
TEMP_PREFIX = ".tmp-"
# Headroom over the estimated checkpoint size (file headers, config, peft metadata).
DISK_MARGIN_BYTES = 64 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the path and what to do."""


@dataclass
class Progress:
    """Where a run stands; saved as progress.json."""
    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    wandb_run_id: str | None = None


@dataclass
class LoadedCheckpoint:
    """A checkpoint read and checked in CPU memory, not yet applied to a model."""
    path: Path
    progress: Progress
    config_yaml: str
    weights: dict[str, torch.Tensor]
    optimizer: dict
    trainer_state: dict


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step}"


def step_of(path: Path) -> int | None:
    suffix = path.name[len(STEP_PREFIX):]
    return int(suffix) if path.name.startswith(STEP_PREFIX) and suffix.isdigit() else None


# ----------------------------------------------------------------------------------------------- writing

def fsync_path(path: Path) -> None:
    """Flush one file, or one directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Flush every file and directory under `directory`, and `directory` itself, to disk."""
    for path in sorted(directory.rglob("*"), reverse=True) + [directory]:
        fsync_path(path)


@contextlib.contextmanager
def atomic_directory(final: Path):
    """Yield a temporary directory next to `final`; on success it is flushed and renamed to `final`
    (replacing an older directory of that name). On error the temporary directory is removed."""
    temp = final.parent / f"{TEMP_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        yield temp
        fsync_tree(temp)
        if final.exists():
            shutil.rmtree(final)
        temp.rename(final)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def write_complete_marker(directory: Path) -> None:
    files = {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}
    temp = directory / f"{TEMP_PREFIX}{COMPLETE_MARKER}"
    temp.write_text(json.dumps({"files": files}, indent=1))
    fsync_path(temp)
    temp.rename(directory / COMPLETE_MARKER)
    fsync_path(directory)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def estimated_size(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    saved = [p for p in model.parameters() if p.requires_grad or not is_lora(model)]
    optimizer_tensors = [v for state in optimizer.state.values() for v in state.values()]
    return tensor_bytes({id(p): p for p in saved}.values()) + tensor_bytes(optimizer_tensors) + DISK_MARGIN_BYTES


def check_free_disk(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointError(
            f"not enough disk for a checkpoint in {directory}: it needs about {needed / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB are free. Free space there, lower checkpoint.keep_last, or give an "
            f"output_dir on a larger disk (and resume=<checkpoint path> to continue from this run)")


def rng_state() -> dict:
    numpy_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": (numpy_state[0], torch.from_numpy(numpy_state[1].copy()),
                                                    *numpy_state[2:]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            log.warning("checkpoint has RNG states of %d GPUs, %d visible: CUDA RNG not restored (dropout "
                        "masks will differ)", len(state["cuda"]), torch.cuda.device_count())
        else:
            torch.cuda.set_rng_state_all(state["cuda"])


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our Llama's weights under Hugging Face names, without a tied head (safetensors stores each tensor
    once). For a peft model: the frozen base, without the adapters."""
    lora = is_lora(model)
    llama = unwrap_llama(model)
    weights = {}
    for name, tensor in llama.state_dict().items():
        if lora and "lora_" in name:
            continue
        weights[name.replace(".base_layer.", ".")] = tensor.detach().contiguous()
    if llama.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def save_hf_model(weights: dict[str, torch.Tensor], config: dict, directory: Path) -> Path:
    """A Hugging Face model directory (config.json + model.safetensors), written atomically."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    check_free_disk(directory.parent, tensor_bytes(weights.values()) + DISK_MARGIN_BYTES)
    with atomic_directory(directory) as temp:
        save_file(weights, temp / FULL_WEIGHTS, metadata={"format": "pt"})
        (temp / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def save_checkpoint(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, data,
                    progress: Progress, config_yaml: str) -> Path:
    """Write checkpoint step-<progress.step> under `root` (see the module docstring); returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{TEMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)    # left by a save that was killed
    check_free_disk(root, estimated_size(model, optimizer))
    final = step_dir(root, progress.step)
    with atomic_directory(final) as temp:
        if is_lora(model):
            model.save_pretrained(temp / ADAPTER_DIR)
        else:
            save_file(full_weights(model), temp / FULL_WEIGHTS, metadata={"format": "pt"})
        torch.save(optimizer.state_dict(), temp / OPTIMIZER_FILE)
        torch.save({"scheduler": scheduler.state_dict(), "rng": rng_state(), "data": data.state_dict()},
                   temp / STATE_FILE)
        (temp / PROGRESS_FILE).write_text(json.dumps(asdict(progress) | {"saved_at": time.time()}, indent=1))
        (temp / CONFIG_FILE).write_text(config_yaml)
    write_complete_marker(final)
    return final


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all), and incomplete ones older
    than the newest complete one."""
    complete = complete_checkpoints(root)
    if not complete:
        return
    doomed = complete[:-keep_last] if keep_last else []
    doomed += [d for d in step_dirs(root) if d not in complete and step_of(d) < step_of(complete[-1])]
    for directory in doomed:
        shutil.rmtree(directory, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- reading

def step_dirs(root: Path) -> list[Path]:
    """step-<N> directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if d.is_dir() and step_of(d) is not None), key=step_of)


def marker_problem(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when its marker and files agree."""
    marker = directory / COMPLETE_MARKER
    if not marker.is_file():
        return "it has no COMPLETE marker (the save was interrupted)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError) as error:
        return f"its COMPLETE marker is unreadable ({error})"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the marker recorded {size}"
    return None


def complete_checkpoints(root: Path) -> list[Path]:
    return [d for d in step_dirs(root) if marker_problem(d) is None]


def read_checkpoint(path: Path) -> LoadedCheckpoint:
    """Read and check every part of the checkpoint at `path`; CheckpointError if anything is off."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory: give a <run dir>/checkpoints/step-<N> "
                              f"directory")
    problem = marker_problem(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {problem}")
    try:
        adapter = path / ADAPTER_DIR / "adapter_model.safetensors"
        weights = load_file(adapter if adapter.is_file() else path / FULL_WEIGHTS)
        return LoadedCheckpoint(
            path=path, progress=Progress(**{k: v for k, v in json.loads((path / PROGRESS_FILE).read_text()).items()
                                            if k in Progress.__dataclass_fields__}),
            config_yaml=(path / CONFIG_FILE).read_text(), weights=weights,
            # Memory-mapped: a full 8B run's optimizer state is ~30 GiB, which should not need to fit in host
            # RAM beside the offload engine's pinned buffers; pages are read as restore copies them.
            optimizer=torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True, mmap=True),
            trainer_state=torch.load(path / STATE_FILE, map_location="cpu", weights_only=True, mmap=True))
    except Exception as error:  # any unreadable part makes the whole checkpoint unusable
        raise CheckpointError(f"checkpoint {path} is corrupt: {type(error).__name__}: {error}") from error


def read_newest(root: Path) -> LoadedCheckpoint | None:
    """The newest readable complete checkpoint under `root`; broken ones are skipped with a warning."""
    for directory in reversed(step_dirs(root)):
        try:
            return read_checkpoint(directory)
        except CheckpointError as error:
            log.warning("skipping %s", error)
    return None


def restore(loaded: LoadedCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
            data) -> Progress:
    """Put model, optimizer, scheduler, data pipeline and RNGs back in the checkpoint's state."""
    if is_lora(model):
        from peft import set_peft_model_state_dict
        result = set_peft_model_state_dict(model, loaded.weights)
        if result.unexpected_keys:
            raise CheckpointError(f"{loaded.path}: adapter tensors {result.unexpected_keys[:5]} do not fit "
                                  f"this model (train.* LoRA settings differ?)")
    elif (loaded.path / ADAPTER_DIR).is_dir():
        raise CheckpointError(f"{loaded.path} holds a LoRA adapter but train.mode=full: resume with train=lora")
    else:
        # A tied head is saved once, as the embedding (full_weights): it is the only key allowed to be absent.
        result = model.load_state_dict(loaded.weights, strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        missing = [key for key in result.missing_keys if key not in tied]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"{loaded.path}: model.safetensors does not fit this model (missing "
                                  f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}; model.* settings "
                                  f"differ?)")
        model.tie_weights()
    optimizer.load_state_dict(loaded.optimizer)
    scheduler.load_state_dict(loaded.trainer_state["scheduler"])
    data.load_state_dict(loaded.trainer_state["data"])
    set_rng_state(loaded.trainer_state["rng"])
    return loaded.progress
