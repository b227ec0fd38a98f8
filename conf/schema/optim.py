"""The `optim` config group: AdamW with linear warmup and cosine decay, and the rules that fill the learning
rate and warmup when they are left at null (auto)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Optional

from conf.errors import ConfigError

log = logging.getLogger(__name__)

# optim.lr=null: the rate for what is trained. The single source of the default learning rates.
LEARNING_RATES = {"lora": (2e-4, "the LoRA rate"), "full": (1e-5, "the full fine-tuning rate")}
# optim.warmup_steps=null: this many, or a tenth of a run too short for it.
WARMUP_STEPS = 20
# Models meant to be trained from random init (conf/model/<name>.yaml selects train=full for them): with
# train=full they get a from-scratch learning rate and warmup instead.
FROM_SCRATCH = {"tiny": {"lr": 1e-3, "warmup_steps": 30}}


@dataclass
class OptimConfig:
    name: str = "adamw"
    # null: LEARNING_RATES by train mode, FROM_SCRATCH for a model trained from random init.
    lr: Optional[float] = None
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    # null: WARMUP_STEPS (FROM_SCRATCH's for those models), lowered to max_steps // 10 for a shorter run.
    warmup_steps: Optional[int] = None
    # Cosine decay ends at lr * min_lr_ratio.
    min_lr_ratio: float = 0.1
    # Clip the global L2 norm of the gradients to this; 0 turns clipping off.
    grad_clip: float = 1.0
    grad_accum_steps: int = 1


def resolve_optim(cfg) -> str:
    """Fill optim.lr and optim.warmup_steps where null; returns what the training takes and why, for the
    startup summary."""
    from_scratch = FROM_SCRATCH.get(cfg.model.name) if cfg.train.mode == "full" else None
    if cfg.optim.lr is not None:
        lr_reason = "set"
    elif from_scratch:
        cfg.optim.lr = from_scratch["lr"]
        lr_reason = f"model={cfg.model.name}'s from-scratch rate" + (
            "; set optim.lr to fine-tune model.path" if cfg.model.path else "")
    else:
        cfg.optim.lr, lr_reason = LEARNING_RATES[cfg.train.mode]
    warmup_reason = "set" if cfg.optim.warmup_steps is not None else resolve_warmup(cfg, from_scratch)
    return (f"{mode_reason(cfg)}, optim.lr={cfg.optim.lr:g} ({lr_reason}), "
            f"optim.warmup_steps={cfg.optim.warmup_steps} ({warmup_reason})")


def resolve_warmup(cfg, from_scratch: dict | None) -> str:
    """The default warmup, capped to a tenth of a run too short for it (none below 10 steps), so a default
    never blocks a smoke run; an explicit warmup_steps >= max_steps stays an error (check_optim)."""
    default = from_scratch["warmup_steps"] if from_scratch else WARMUP_STEPS
    reason = f"model={cfg.model.name}'s default" if from_scratch else "the default"
    if default < cfg.max_steps:
        cfg.optim.warmup_steps = default
        return reason
    cfg.optim.warmup_steps = cfg.max_steps // 10
    log.info("optim.warmup_steps=%d: %s of %d is not below max_steps=%d, so a tenth of the run",
             cfg.optim.warmup_steps, reason, default, cfg.max_steps)
    return f"{reason} {default}, capped below max_steps={cfg.max_steps}"


def mode_reason(cfg) -> str:
    """train.mode and where it comes from (conf/config.yaml selects train=lora; a FROM_SCRATCH model's group
    selects train=full)."""
    mode, model = cfg.train.mode, cfg.model.name
    if model in FROM_SCRATCH:
        start = f"it fine-tunes model.path={cfg.model.path}" if cfg.model.path else "it trains from random init"
        return (f"train.mode=full (model={model}'s default: {start}, every parameter; train=lora for adapters)"
                if mode == "full" else f"train.mode={mode} (chosen over model={model}'s default train=full)")
    return ("train.mode=lora (the default; train=full for every parameter)" if mode == "lora" else
            f"train.mode={mode} (train={mode}; the default is train=lora)")


def check_optim(optim_cfg, max_steps: int) -> None:
    """The resolved optim settings (resolve_optim ran)."""
    if optim_cfg.grad_accum_steps < 1:
        raise ConfigError(f"optim.grad_accum_steps={optim_cfg.grad_accum_steps} must be at least 1")
    if optim_cfg.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={optim_cfg.warmup_steps} must be >= 0 (or null for the default)")
    if optim_cfg.warmup_steps >= max_steps:
        raise ConfigError(f"optim.warmup_steps={optim_cfg.warmup_steps} must be below max_steps={max_steps}: "
                          f"lower the warmup (or null for the default) or raise max_steps")
    if not 0.0 <= optim_cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={optim_cfg.min_lr_ratio} must be within [0, 1]")
    if optim_cfg.lr <= 0:
        raise ConfigError(f"optim.lr={optim_cfg.lr} must be positive")
    if optim_cfg.grad_clip < 0:
        raise ConfigError(f"optim.grad_clip={optim_cfg.grad_clip} must be >= 0 (0 turns clipping off)")
