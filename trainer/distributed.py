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
from torch.distributed.tensor import DTensor

from conf.schema.parallel import world_size
from conf.validate import ConfigError


class MainRankFailed(RuntimeError):
    """Rank 0 failed at something only it does (World.on_main); this rank stops with it."""


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
    def data_parallel(self) -> int:
        """Sequence-parallel groups, each on its own batches."""
        return self.size // self.sequence

    @property
    def data_rank(self) -> int:
        """This rank's sequence-parallel group: which of the step's batches it trains on."""
        return self.rank // self.sequence

    @property
    def is_main(self) -> bool:
        """The rank that writes the run directory, the metrics and W&B, and shows the console."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def main_value(self, value):
        """Rank 0's `value` on every rank (a picklable object): what must not differ between ranks, such as
        an output_dir resolved from the clock."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, action) -> None:
        """Run `action` (a write to the run directory) on rank 0 alone and let every rank learn how it went:
        when it raises, rank 0 raises its error and the others MainRankFailed with its message, instead of
        waiting in the next collective for a rank that has gone. A barrier too: no rank returns before rank 0
        has finished."""
        if not self.distributed:
            action()
            return
        failure = None
        if self.is_main:
            try:
                action()
            except Exception as error:      # every rank must hear of it, whatever it is
                failure = error
        message = self.main_value(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if message is not None:
            raise MainRankFailed(f"rank 0 failed, so rank {self.rank} stops too: {message}")

    def gather(self, value) -> list:
        """Every rank's `value` (a picklable object), by rank, on every rank."""
        if not self.distributed:
            return [value]
        values = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def any(self, flags: list[bool]) -> list[bool]:
        """Each flag true on any rank: decisions every rank must take together (stop, checkpoint now)."""
        return [total > 0 for total in self.sum([float(flag) for flag in flags])]

    def max(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's maximum over the ranks (memory peaks)."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def min(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's minimum over the ranks (the memory every rank can plan with)."""
        return self._reduce(values, dist.ReduceOp.MIN)

    def _reduce(self, values: dict[str, float], op) -> dict[str, float]:
        if not self.distributed:
            return values
        reduced = torch.tensor(list(values.values()), dtype=torch.float64, device=_reduce_device())
        dist.all_reduce(reduced, op=op)
        return dict(zip(values, reduced.tolist()))

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
        # A sharded parameter's gradient (a DTensor) was summed by FSDP2's reduce-scatter already.
        grads = [p.grad for p in parameters if p.grad is not None and not isinstance(p.grad, DTensor)]
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


def local_rank() -> int:
    """This process's index among those torchrun started on its machine."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def ranks_per_host() -> int:
    """The processes of this job on this machine, which share its host memory."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def rank_device(device: torch.device) -> torch.device:
    """The device of this process: on CUDA, the GPU of its local rank; a ConfigError when the machine has
    fewer GPUs than torchrun started processes on it (else CUDA's "invalid device ordinal" on one rank)."""
    if device.type != "cuda":
        return device
    gpus = torch.cuda.device_count()
    if local_rank() >= gpus:
        raise ConfigError(f"torchrun started {ranks_per_host()} processes on this machine, which has {gpus} "
                          f"GPU(s): start at most {gpus} (--nproc-per-node={gpus}), or give device=cpu to train "
                          f"on the CPU")
    return torch.device("cuda", local_rank())


def init_world(sequence: int, device: torch.device) -> World:
    """The world torchrun started this process in (RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
    variables), with its process groups, on `device` (rank_device); `World.single()` when it started one
    process."""
    if world_size() == 1:
        return World.single()
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return world_of(dist.get_rank(), dist.get_world_size(), sequence)


def close_world(world: World) -> None:
    """Release the process groups of a distributed world at the end of the job; `world` lets go of its
    sequence group first, as nothing may hold a group past its destruction (trainer.build.release_sequence_group)."""
    world.sequence_group = None
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def world_of(rank: int, size: int, sequence: int) -> World:
    """The World of an initialized process group: every rank creates every sequence group, in one order,
    as torch.distributed requires, and keeps its own."""
    own = None
    for first in range(0, size, sequence):
        group = dist.new_group(list(range(first, first + sequence)))
        if first <= rank < first + sequence:
            own = group
    return World(rank=rank, size=size, sequence=sequence, sequence_group=own)
