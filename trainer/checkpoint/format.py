"""One training checkpoint on disk, <run dir>/checkpoints/step-<N>/: what it holds, writing and reading it,
and the COMPLETE marker that tells a complete one from an interrupted save.

Contents: the trainable weights (LoRA: peft's adapter format in adapter/, which names its base and task so
that peft.AutoPeftModelForCausalLM loads it onto transformers' model, and load_adapter onto ours; full
fine-tuning: model.safetensors), optimizer.pt, trainer_state.pt (LR
scheduler, RNG states, data-pipeline state), progress.json (step, tokens seen, skipped steps, W&B run id)
and config.yaml (the resolved config of the run). A run over several processes saves the trainable weights
and optimizer state in state/ instead (trainer.checkpoint.sharded_state: DCP, readable on any number of processes),
LoRA's adapter/ beside it for export. The COMPLETE marker, written last, lists every file with
its size and CRC-32 (storage.checksum); a directory without a valid marker is incomplete and never resumed
from, and one whose files no longer match their checksums is corrupt. (Markers written before checksums were
recorded list sizes only: such a checkpoint is still read, checked by its sizes.)
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from model.hf_checkpoint import WEIGHTS_FILE, full_weights, is_lora, save_weights
from storage.atomic import atomic_write_text
from storage.checksum import ALGORITHM, ChecksumWriter, file_checksum
from trainer.checkpoint.rng_state import capture_rng_state, own_cuda_rng_state
from trainer.checkpoint.sharded_state import STATE_DIR, save_sharded_state, trainable_weights
from trainer.distributed import World
from trainer.sharding import is_sharded

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
STEP_PREFIX = "step-"
COMPLETE_MARKER = "COMPLETE"
ADAPTER_DIR = "adapter"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.pt"
PROGRESS_FILE = "progress.json"
CONFIG_FILE = "config.yaml"


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
    weights: dict[str, torch.Tensor]       # empty when the state is in state_dir
    optimizer: dict | None
    trainer_state: dict
    # A run over several processes saved its trainable weights and optimizer state here (sharded_state):
    # loaded into the built model, as DCP needs.
    state_dir: Path | None = None


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step}"


def step_of(path: Path) -> int | None:
    suffix = path.name[len(STEP_PREFIX):]
    return int(suffix) if path.name.startswith(STEP_PREFIX) and suffix.isdigit() else None


def step_dirs(root: Path) -> list[Path]:
    """step-<N> directories under `root`, oldest first; an empty one (empty_step_dirs) holds nothing to read."""
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if d.is_dir() and step_of(d) is not None and any(d.iterdir())),
                  key=step_of)


def empty_step_dirs(root: Path) -> list[Path]:
    """Empty step-<N> directories under `root`: what a deletion (keep_last, a save replacing a directory of its
    name) leaves when it is interrupted after emptying the directory. A save never leaves one (it renames a
    full directory into place)."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and step_of(d) is not None and not any(d.iterdir()))


def write_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, data,
                     progress: Progress, config_yaml: str, world: World = World.single()) -> dict[str, str]:
    """Every file of a checkpoint, into the (empty, temporary) `directory`; the marker comes later. Over
    several processes (collective: every rank calls it) the trainable weights and optimizer state go to
    state/ through DCP (trainer.checkpoint.sharded_state), and rank 0 writes the rest, the adapter included.
    Returns the checksums of the files written through a file object (the torch.save files), by name; the
    marker reads the others back."""
    cuda_by_rank = None
    adapter = None
    if world.distributed:
        save_sharded_state(directory / STATE_DIR, model, optimizer)
        cuda_by_rank = world.gather(own_cuda_rng_state())
        # Sharded adapters (FSDP2) are gathered whole for adapter/ (collective); replicated ones are whole.
        adapter = trainable_weights(model) if is_lora(model) and is_sharded(model) else None
        if not world.is_main:
            return {}
    if is_lora(model):
        # The vocabulary is never resized, so the base's embeddings never belong in the adapter; "auto" would
        # read the base's config (model.path, or the hub) to find out.
        # Given the trained weights, peft does not ask the whole model's state_dict, which would also build a
        # bf16 copy of every FP8 base weight (model/fp8.py's Fp8Linear) on the GPU.
        adapter = adapter if adapter is not None else {name: parameter.detach() for name, parameter
                                                       in model.named_parameters() if parameter.requires_grad}
        model.save_pretrained(directory / ADAPTER_DIR, state_dict=adapter, save_embedding_layers=False)
    elif not world.distributed:
        save_weights(full_weights(model), directory)
    checksums = {}
    if not world.distributed:
        checksums[OPTIMIZER_FILE] = save_checksummed(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    checksums[STATE_FILE] = save_checksummed(
        {"scheduler": scheduler.state_dict(), "rng": capture_rng_state(cuda_by_rank), "data": data.state_dict()},
        directory / STATE_FILE)
    (directory / PROGRESS_FILE).write_text(json.dumps(asdict(progress) | {"saved_at": time.time()}, indent=1))
    (directory / CONFIG_FILE).write_text(config_yaml)
    return checksums


def save_checksummed(state, path: Path) -> str:
    """torch.save `state` to `path`; returns the CRC-32 of the bytes written."""
    with open(path, "wb") as file:
        writer = ChecksumWriter(file)
        torch.save(state, writer)
    return writer.checksum


def load_adapter(llama: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """Our CausalLM with a saved adapter, wrapped as training wraps it (trainer.build.apply_lora). The adapter
    says task_type CAUSAL_LM for transformers' models, whose peft wrapper our CausalLM does not fit (it has no
    generate()), so the task is dropped here."""
    from peft import PeftConfig, PeftModel
    config = PeftConfig.from_pretrained(str(adapter_dir))
    config.task_type = None
    return PeftModel.from_pretrained(llama, adapter_dir, config=config)


def write_complete_marker(directory: Path, checksums: dict[str, str]) -> None:
    """The COMPLETE marker: every file's size and checksum, those not in `checksums` (computed while writing)
    read back."""
    paths = {str(p.relative_to(directory)): p for p in sorted(directory.rglob("*")) if p.is_file()}
    files = {name: path.stat().st_size for name, path in paths.items()}
    sums = {name: checksums.get(name) or file_checksum(path) for name, path in paths.items()}
    atomic_write_text(directory / COMPLETE_MARKER, json.dumps({"files": files, ALGORITHM: sums}, indent=1))


def read_marker(directory: Path) -> tuple[dict | None, str | None]:
    """(The marker's content, None), or (None, why `directory` has no valid marker)."""
    marker = directory / COMPLETE_MARKER
    if not marker.is_file():
        return None, "it has no COMPLETE marker (the save was interrupted)"
    try:
        content = json.loads(marker.read_text())
        if "files" not in content:
            raise KeyError("files")
    except (ValueError, KeyError) as error:
        return None, f"its COMPLETE marker is unreadable ({error})"
    return content, None


def marker_problem(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when its marker and files' sizes agree (cheap:
    reads no file's content; content_problem does)."""
    content, problem = read_marker(directory)
    if problem:
        return problem
    for name, size in content["files"].items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the marker recorded {size}"
    return None


def content_problem(directory: Path) -> str | None:
    """marker_problem, and whether every file still has the checksum recorded when it was written (reads
    every byte). A marker from before checksums were recorded is checked by sizes only."""
    problem = marker_problem(directory)
    if problem:
        return problem
    checksums = read_marker(directory)[0].get(ALGORITHM)
    if checksums is None:
        log.warning("checkpoint %s has no checksums (saved before they were recorded): checked by file sizes "
                    "only", directory)
    for name, recorded in (checksums or {}).items():
        found = file_checksum(directory / name)
        if found != recorded:
            return f"{name} does not match its {ALGORITHM} checksum (recorded {recorded}, found {found})"
    return None


def complete_checkpoints(root: Path) -> list[Path]:
    return [d for d in step_dirs(root) if marker_problem(d) is None]


def read_checkpoint(path: Path, verify: bool = True) -> LoadedCheckpoint:
    """Read and check every part of the checkpoint at `path`; CheckpointError if anything is off. `verify`:
    check every file's checksum (reads every byte), else only the marker and the files' sizes (for a rank
    reading a checkpoint rank 0 has verified)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory: give a <run dir>/checkpoints/step-<N> "
                              f"directory")
    problem = content_problem(path) if verify else marker_problem(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {problem}")
    try:
        sharded = path / STATE_DIR
        adapter = path / ADAPTER_DIR / "adapter_model.safetensors"
        loaded = LoadedCheckpoint(
            path=path, progress=Progress(**{k: v for k, v in json.loads((path / PROGRESS_FILE).read_text()).items()
                                            if k in Progress.__dataclass_fields__}),
            config_yaml=(path / CONFIG_FILE).read_text(),
            weights={} if sharded.is_dir() else load_file(adapter if adapter.is_file() else path / WEIGHTS_FILE),
            # Memory-mapped: a full 8B run's optimizer state is ~30 GiB, which should not need to fit in host
            # RAM beside the offload engine's pinned buffers; pages are read as restore copies them.
            optimizer=None if sharded.is_dir() else torch.load(path / OPTIMIZER_FILE, map_location="cpu",
                                                               weights_only=True, mmap=True),
            trainer_state=torch.load(path / STATE_FILE, map_location="cpu", weights_only=True, mmap=True),
            state_dir=sharded if sharded.is_dir() else None)
    except Exception as error:  # any unreadable part makes the whole checkpoint unusable
        raise CheckpointError(f"checkpoint {path} is corrupt: {type(error).__name__}: {error}") from error
    named = step_of(path)
    if named is not None and named != loaded.progress.step:     # renamed by hand: its place in the order is false
        raise CheckpointError(f"checkpoint {path} holds step {loaded.progress.step} (its {PROGRESS_FILE}), not "
                              f"{named}: rename it {STEP_PREFIX}{loaded.progress.step} to resume from it")
    return loaded
