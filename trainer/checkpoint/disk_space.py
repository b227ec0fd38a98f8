"""Free disk, checked before a checkpoint or an exported model is written: a full disk is then a clear error
that names what to do, raised before anything is written, instead of a write failing halfway."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from model.hf_checkpoint import is_lora, save_hf_model
from offload.units import GIB
from storage.atomic import disk_is_full
from trainer.checkpoint.format import CHECKPOINTS_DIR, CheckpointError, complete_checkpoints

# Headroom over the estimated size (file headers, config, peft metadata).
DISK_MARGIN_BYTES = 64 << 20


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def check_free_disk(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointError(
            f"not enough disk for a checkpoint in {directory}: it needs about {needed / GIB:.2f} GiB, "
            f"{free / GIB:.2f} GiB are free. Free space there, lower checkpoint.keep_last, or give an "
            f"output_dir on a larger disk (and resume=<checkpoint path> to continue from this run)")


def full_disk_line(error: BaseException, run_dir: Path) -> str | None:
    """The one line for a job stopped by a full disk (ENOSPC or a quota, or any error while the run directory's
    disk has less than DISK_MARGIN_BYTES free: torch.save reports a failed write as a RuntimeError); None for
    another error."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    if not disk_is_full(error) and free >= DISK_MARGIN_BYTES:
        return None
    newest = complete_checkpoints(run_dir / CHECKPOINTS_DIR)
    kept = f"newest {newest[-1]}" if newest else "none was written yet"
    return (f"the disk of output_dir={run_dir} is full ({free / 2**20:.1f} MiB free; {error}): the job stopped. "
            f"Its checkpoints are intact ({kept}): free space there, or lower checkpoint.keep_last, and run it "
            f"again with this output_dir to continue")


def checkpoint_size(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """About how many bytes a checkpoint of `model` and `optimizer` takes on disk."""
    saved = [p for p in model.parameters() if p.requires_grad or not is_lora(model)]
    optimizer_tensors = [v for state in optimizer.state.values() for v in state.values()]
    return tensor_bytes({id(p): p for p in saved}.values()) + tensor_bytes(optimizer_tensors) + DISK_MARGIN_BYTES


def save_hf_model_if_room(weights: dict[str, torch.Tensor], config: dict, directory: Path,
                          companions: list[Path] = ()) -> Path:
    """model.hf_checkpoint.save_hf_model, after checking that the disk has room (CheckpointError if not)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    check_free_disk(directory.parent, tensor_bytes(weights.values()) + DISK_MARGIN_BYTES)
    return save_hf_model(weights, config, directory, companions)
