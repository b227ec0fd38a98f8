"""Job-wide settings, those outside the model/data/optim/train/memory groups: sizes, device, kernel
backend, checkpointing, logging, resume and the NaN/Inf guard; with their checks."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch

from conf.capability import triton_interpreting
from conf.errors import ConfigError

DEVICES = ("auto", "cuda", "cpu")
KERNEL_BACKENDS = ("auto", "triton", "reference")
WANDB_MODES = ("offline", "online", "disabled")
MAX_SEED = 2**32 - 1     # numpy.random.seed takes [0, 2**32 - 1]


@dataclass
class CheckpointConfig:
    """When checkpoints are written to <output_dir>/checkpoints/step-<N>/ (0 disables a trigger)."""
    every_steps: int = 200
    every_minutes: float = 30.0
    # Complete checkpoints kept; older ones are deleted only after a newer one is complete. 0 keeps all.
    keep_last: int = 3
    # LoRA on a random-init base: save the base once in <output_dir>/base_model/ so scripts/export.py can
    # merge into it. False skips the copy (export is then refused for the run).
    save_random_base: bool = True


@dataclass
class WandbConfig:
    # offline (default: no account needed, `wandb sync <output_dir>/wandb/offline-run-*` later) | online |
    # disabled. Files go to <output_dir>/wandb/.
    mode: str = "offline"
    project: str = "longctx"
    entity: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Peak bf16 TFLOP/s of the GPU, the MFU denominator. None: its datasheet dense peak (trainer.metrics:
    # 989 for the H100 and H200 SXM, 312 for the A100); a GPU without one there records no MFU. None on CPU.
    peak_tflops: Optional[float] = None
    # tqdm progress bar on an interactive terminal; log lines every `log_every` steps either way.
    progress_bar: bool = True


def resolve_device(requested: str) -> torch.device:
    """The device `device=` names; auto picks CUDA when a GPU is visible."""
    if requested not in DEVICES:
        raise ConfigError(f"device={requested!r} is not one of {DEVICES}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA GPU is visible: use device=auto or device=cpu")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def check_kernels_backend(name: str) -> None:
    """ConfigError when backend `name` is unknown or cannot run here (Triton needs CUDA, or
    TRITON_INTERPRET=1 to run the kernels through Triton's CPU interpreter)."""
    if name not in KERNEL_BACKENDS:
        raise ConfigError(f"kernels={name!r} is not one of {KERNEL_BACKENDS}")
    if name == "triton" and not (torch.cuda.is_available() or triton_interpreting()):
        raise ConfigError(
            "kernels=triton needs a CUDA GPU (or TRITON_INTERPRET=1 to run the kernels slowly on CPU); "
            "use kernels=auto or kernels=reference on this machine")


def check_job(cfg) -> None:
    """The top-level settings of a composed JobConfig (docs/JOBS.md for checkpointing and the guard)."""
    for name in ("seq_len", "batch_size", "max_steps", "log_every"):
        if cfg[name] < 1:
            raise ConfigError(f"{name}={cfg[name]} must be at least 1")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"seed={cfg.seed} must be within [0, {MAX_SEED}]")
    check_kernels_backend(cfg.kernels)
    resolve_device(cfg.device)
    for name in ("every_steps", "every_minutes", "keep_last"):
        if cfg.checkpoint[name] < 0:
            raise ConfigError(f"checkpoint.{name}={cfg.checkpoint[name]} must be >= 0 (0 disables it)")
    if cfg.logger.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"logger.wandb.mode={cfg.logger.wandb.mode!r} is not one of {WANDB_MODES}")
    if cfg.logger.peak_tflops is not None and cfg.logger.peak_tflops <= 0:
        raise ConfigError(f"logger.peak_tflops={cfg.logger.peak_tflops} must be positive (the GPU's bf16 peak), "
                          f"or null for its datasheet peak")
    if cfg.max_bad_steps < 1:
        raise ConfigError(f"max_bad_steps={cfg.max_bad_steps} must be at least 1")
    cfg.output_dir = os.path.expanduser(cfg.output_dir)     # every user of the setting sees one path
    check_output_dir(cfg.output_dir)


def check_output_dir(output_dir: str) -> None:
    """What can be told without writing: output_dir is, or would be created in, a writable directory. The
    trainer creates it (trainer.run_dir.create_run_dir), naming output_dir if that still fails (/proc/x)."""
    path = Path(output_dir).absolute()
    try:
        is_file = path.exists() and not path.is_dir()
        existing = next(parent for parent in (path, *path.parents) if parent.exists())
    except OSError as error:         # e.g. a parent that cannot be entered
        raise ConfigError(f"output_dir={output_dir!r} cannot be used: {error.strerror}") from None
    if is_file:
        raise ConfigError(f"output_dir={output_dir!r} is a file: give a directory (new or a previous run's)")
    if not existing.is_dir():
        raise ConfigError(f"output_dir={output_dir!r} is under the file {str(existing)!r}: give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir={output_dir!r} cannot be created: {str(existing)!r} is not writable")
