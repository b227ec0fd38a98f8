"""Cross-field checks run on the composed config before anything heavy is built."""
from __future__ import annotations

from pathlib import Path

import torch

import data
import kernels
from offload import state_layouts
from offload.config import check_memory_config
from trainer.wandb_run import MODES as WANDB_MODES

DEVICES = ("auto", "cuda", "cpu")
TRAIN_MODES = ("lora", "full")
FULL_STATES = ("auto", *state_layouts.LAYOUTS)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the setting to change."""


def resolve_device(requested: str) -> torch.device:
    if requested not in DEVICES:
        raise ConfigError(f"device={requested!r} is not one of {DEVICES}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA GPU is visible: use device=auto or device=cpu")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def validate(cfg) -> None:
    """Raise ConfigError naming the fix for the first invalid combination found."""
    positive = {"seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "max_steps": cfg.max_steps,
                "log_every": cfg.log_every, "optim.grad_accum_steps": cfg.optim.grad_accum_steps}
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name}={value} must be at least 1")
    if cfg.kernels not in kernels.BACKENDS:
        raise ConfigError(f"kernels={cfg.kernels!r} is not one of {kernels.BACKENDS}")
    try:
        kernels.check_available(cfg.kernels)
    except RuntimeError as error:
        raise ConfigError(str(error)) from error
    resolve_device(cfg.device)
    if cfg.optim.warmup_steps >= cfg.max_steps:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} must be below max_steps={cfg.max_steps}: "
                          f"lower the warmup or raise max_steps")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be within [0, 1]")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be positive")
    if cfg.train.mode not in TRAIN_MODES:
        raise ConfigError(f"train.mode={cfg.train.mode!r} is not one of {TRAIN_MODES} (choose train=lora or train=full)")
    if cfg.train.full_state not in FULL_STATES:
        raise ConfigError(f"train.full_state={cfg.train.full_state!r} is not one of {FULL_STATES}")
    if cfg.train.mode == "lora" and cfg.train.lora_r < 1:
        raise ConfigError(f"train.lora_r={cfg.train.lora_r} must be at least 1")
    if cfg.model.path is not None and not Path(cfg.model.path).expanduser().is_dir():
        raise ConfigError(f"model.path={cfg.model.path!r} is not a directory: give a local Hugging Face "
                          f"checkpoint directory, or drop model.path for random init")
    if cfg.model.num_attention_heads % cfg.model.num_key_value_heads:
        raise ConfigError(f"model.num_attention_heads={cfg.model.num_attention_heads} must be a multiple of "
                          f"model.num_key_value_heads={cfg.model.num_key_value_heads}")
    validate_job_settings(cfg)
    try:
        data.check_data_config(cfg.data, cfg.seq_len, cfg.model.vocab_size, tokenizer_path=cfg.model.path)
        check_memory_config(cfg.memory)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def validate_job_settings(cfg) -> None:
    """Checkpointing, logging and guard settings (docs/JOBS.md)."""
    for name in ("every_steps", "every_minutes", "keep_last"):
        if cfg.checkpoint[name] < 0:
            raise ConfigError(f"checkpoint.{name}={cfg.checkpoint[name]} must be >= 0 (0 disables it)")
    if cfg.logger.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"logger.wandb.mode={cfg.logger.wandb.mode!r} is not one of {WANDB_MODES}")
    if cfg.logger.peak_tflops <= 0:
        raise ConfigError(f"logger.peak_tflops={cfg.logger.peak_tflops} must be positive (the accelerator's peak)")
    if cfg.max_bad_steps < 1:
        raise ConfigError(f"max_bad_steps={cfg.max_bad_steps} must be at least 1")
