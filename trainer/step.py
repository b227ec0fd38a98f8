"""One optimizer step over gradient-accumulation micro-batches."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from data import IGNORE_INDEX, Batch
from model import unwrap_model
from trainer.distributed import World
from trainer.guard import update_is_finite

# Accuracy is logged only when the supervised tokens are few enough that their logits are cheap.
MAX_ACCURACY_TOKENS = 4096


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    accuracy: float | None
    tokens: int
    supervised: int
    # False when the loss or gradients were NaN/Inf and the update was skipped (trainer.guard).
    applied: bool = True


def autocast(device: torch.device):
    """bf16 autocast on CUDA; exact fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def supervised_correct(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[int, int] | None:
    """(correct next-token predictions, supervised tokens) of one micro-batch; None when it has more than
    MAX_ACCURACY_TOKENS supervised tokens (their logits would not be cheap)."""
    mask = labels != IGNORE_INDEX
    count = int(mask.sum())
    if count > MAX_ACCURACY_TOKENS:
        return None
    if count == 0:
        return 0, 0
    with torch.no_grad():
        logits = hidden[mask].float() @ unwrap_model(model).lm_head.weight.float().t()
        return int((logits.argmax(-1) == labels[mask]).sum()), count


def clip_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> torch.Tensor:
    """Clip to global L2 norm `grad_clip` (0: no clipping); returns the norm before clipping. An
    optimizer that gathers gradients itself during the backward (StreamedAdamW) computes it."""
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    if hasattr(optimizer, "clip_grad_norm_"):
        return optimizer.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm     # over sharded gradients (FSDP2)


def train_step(model: torch.nn.Module, micro_batches: list[Batch], optimizer: torch.optim.Optimizer,
               scheduler, grad_clip: float, device: torch.device, world: World = World.single()) -> StepResult:
    """Forward/backward every micro-batch, clip, update (skipped when the loss or gradients are not finite).

    The loss is the mean over all supervised tokens of the step (not a mean of micro-batch means), so
    accumulation over k micro-batches equals one batch k times larger; so is the accuracy (None when a
    micro-batch has too many supervised tokens for it, or the step none). Over several processes (`world`)
    each rank runs its slice of its sequence-parallel group's batches, the loss is divided by the supervised
    tokens of the whole world, and the gradients are summed over it: the step equals one process's on all
    of the world's batches.
    """
    optimizer.zero_grad(set_to_none=True)
    # A sequence-parallel group shares its batches: count them once per group.
    supervised, tokens = (int(total) // world.sequence for total in world.sum(
        [sum(b.num_supervised for b in micro_batches), sum(b.num_tokens for b in micro_batches)]))
    lm = unwrap_model(model)
    total_loss, correct, counted, unmeasurable = 0.0, 0, 0, 0
    for batch in micro_batches:
        batch = batch.shard(world.sequence_rank, world.sequence).to(device)
        with autocast(device):
            hidden = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens)
            loss = lm.loss(hidden, batch.labels, reduction="sum") / max(supervised, 1)
        # A sharded (FSDP2) head is whole only from the forward until its gradient is taken: tally before the
        # backward there. Elsewhere after it, when the backward's transients (GiBs at 8B) are gone.
        head_sharded = isinstance(lm, FSDPModule)
        tally = supervised_correct(model, hidden.detach(), batch.labels) if head_sharded else None
        loss.backward()
        if not head_sharded:
            tally = supervised_correct(model, hidden.detach(), batch.labels)
        total_loss += float(loss.detach())
        if tally is None:
            unmeasurable += 1
        else:
            correct, counted = correct + tally[0], counted + tally[1]
        # The output (B x S x hidden, GiBs at long context) must not live on through the next micro-batch.
        del hidden, loss
    world.sum_gradients(p for p in model.parameters() if p.requires_grad)
    total_loss, correct, counted, unmeasurable = world.sum([total_loss, correct, counted, unmeasurable])
    accuracy = correct / counted if not unmeasurable and counted else None
    grad_norm = clip_gradients(model, optimizer, grad_clip)
    applied = update_is_finite(total_loss, float(grad_norm))
    if applied:
        optimizer.step()
    # The schedule advances on skipped steps too, so the learning rate is a function of the step alone.
    scheduler.step()
    return StepResult(loss=total_loss, grad_norm=float(grad_norm), accuracy=accuracy,
                      tokens=tokens, supervised=supervised, applied=applied)
