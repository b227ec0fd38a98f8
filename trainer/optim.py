"""AdamW and the warmup + cosine learning-rate schedule."""
from __future__ import annotations

import math

import torch

from trainer.streamed_adamw import StreamedAdamW, update_units


def build_optimizer(model: torch.nn.Module, cfg, full_state: str | None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; norms and other 1-D parameters get no weight decay.
    torch.optim.AdamW, or StreamedAdamW where the memory plan's optimizer-state layout `full_state`
    (offload.state_layouts; None for LoRA) keeps bf16 weights."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters: check train.mode and train.lora_target_modules")
    decayed = [p for p in trainable if p.dim() >= 2]
    plain = [p for p in trainable if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if full_state is not None and full_state != "fp32":
        return StreamedAdamW(groups, update_units(model), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             grads_on_host=full_state == "bf16_host_grads", device=trainable[0].device)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup from 1/warmup to 1, then cosine decay from 1 to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio))


def continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, saved_state: dict) -> None:
    """Resume at the saved step on this job's schedule (its optim settings and max_steps, which may differ
    from the checkpoint's): the next step's learning rate is the one this schedule gives at that step.
    Call after the optimizer's state is loaded, which brings back the learning rate it last applied."""
    step = saved_state["last_epoch"]
    scheduler.load_state_dict(saved_state | {"base_lrs": scheduler.base_lrs, "last_epoch": step - 1})
    scheduler.step()     # to the saved step, setting the optimizer's learning rate from this schedule
