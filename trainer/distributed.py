"""The processes of a job launched by torchrun, and the reductions a step needs across them.

The world of W ranks splits into W / P sequence-parallel groups of P consecutive ranks (parallel.sequence):
the ranks of one group train on one batch, each on a slice of its sequence; the groups are data parallel,
each on its own batch. Parameters are replicated, so each gradient is summed over the whole world after the
backward, and every rank takes the same update. One process (no torchrun): `World.single()`, for which
every method here is a no-op, so the single-GPU path is unchanged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from conf.schema.parallel import world_size


@dataclass
class World:
    rank: int
    size: int
    sequence: int                  # ranks per sequence-parallel group
    sequence_group: object = None  # this rank's sequence-parallel group (None: one process)

    @classmethod
    def single(cls) -> "World":
        return cls(rank=0, size=1, sequence=1)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def sequence_rank(self) -> int:
        """This rank's slice of the sequence within its group."""
        return self.rank % self.sequence

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over every rank (fp64, so token counts stay exact)."""
        if not self.distributed:
            return values
        total = torch.tensor(values, dtype=torch.float64, device=_reduce_device())
        dist.all_reduce(total)
        return total.tolist()

    def sum_gradients(self, parameters) -> None:
        """Sum each gradient over the world, in one flat buffer per dtype and device (fewer, larger
        collectives); the loss was already divided by the world's supervised tokens."""
        if not self.distributed:
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for grad in grads:
            by_kind.setdefault((grad.dtype, grad.device), []).append(grad)
        for group in by_kind.values():
            flat = torch.cat([grad.reshape(-1) for grad in group])
            dist.all_reduce(flat)
            for grad, summed in zip(group, flat.split([grad.numel() for grad in group])):
                grad.copy_(summed.view_as(grad))


def _reduce_device() -> torch.device:
    """Where small reductions run: NCCL reduces CUDA tensors only, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def init_world(sequence: int, device: torch.device) -> World:
    """The world torchrun started this process in (RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
    variables), with its process groups; `World.single()` when it started one process."""
    if world_size() == 1:
        return World.single()
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return world_of(dist.get_rank(), dist.get_world_size(), sequence)


def world_of(rank: int, size: int, sequence: int) -> World:
    """The World of an initialized process group: every rank creates every sequence group, in one order,
    as torch.distributed requires, and keeps its own."""
    own = None
    for first in range(0, size, sequence):
        group = dist.new_group(list(range(first, first + sequence)))
        if first <= rank < first + sequence:
            own = group
    return World(rank=rank, size=size, sequence=sequence, sequence_group=own)
