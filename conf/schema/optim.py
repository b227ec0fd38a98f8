"""The `optim` config group: AdamW with linear warmup and cosine decay."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from conf.errors import ConfigError


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 2e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 20
    # Cosine decay ends at lr * min_lr_ratio.
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    grad_accum_steps: int = 1


def check_optim(optim_cfg, max_steps: int) -> None:
    if optim_cfg.grad_accum_steps < 1:
        raise ConfigError(f"optim.grad_accum_steps={optim_cfg.grad_accum_steps} must be at least 1")
    if optim_cfg.warmup_steps >= max_steps:
        raise ConfigError(f"optim.warmup_steps={optim_cfg.warmup_steps} must be below max_steps={max_steps}: "
                          f"lower the warmup or raise max_steps")
    if not 0.0 <= optim_cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={optim_cfg.min_lr_ratio} must be within [0, 1]")
    if optim_cfg.lr <= 0:
        raise ConfigError(f"optim.lr={optim_cfg.lr} must be positive")
