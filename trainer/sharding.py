"""FSDP2 over the ranks of a job (parallel.shard=true): each decoder layer's parameters, and with them their
gradients and AdamW state, are split over the world and gathered for the layer's forward and backward
(torch.distributed.fsdp.fully_shard), so each GPU holds 1/world of the full fine-tuning state, or of LoRA's
frozen base and its adapters (a layer's bf16 base and fp32 adapters are gathered together).

Sharded after the memory policy is installed: a recomputed layer gathers its parameters again for its
recompute. Gradients are summed over the ranks, not averaged, as trainer.step divides the loss by the
world's supervised tokens; the other parameters' gradients are summed by `World.sum_gradients`, which
leaves these (DTensors) alone.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from model import unwrap_model
from trainer.distributed import World


def shard_model(model: torch.nn.Module, world: World, device: torch.device) -> None:
    """Shard each decoder layer of `model` over `world`, then the rest (embeddings, final norm, head) as
    the root; in place."""
    mesh = init_device_mesh(device.type, (world.size,))
    lm = unwrap_model(model)
    sharded = [*lm.model.layers, lm]
    for module in sharded:
        fully_shard(module, mesh=mesh)
    for module in sharded:
        module.set_gradient_divide_factor(1.0)
        # Sum-only collectives: gloo has no pre-multiplied sum, and NCCL's are zero-copy only for sums.
        module.set_force_sum_reduction_for_comms(True)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is split over the ranks (shard_model)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def sharding(model: torch.nn.Module) -> str:
    """What the startup summary says: how the model's parameters are held, as they are."""
    sharded = sum(p.numel() for p in model.parameters() if isinstance(p, DTensor))
    return f", FSDP2: {sharded / 1e6:.2f}M parameters sharded" if sharded else ""
