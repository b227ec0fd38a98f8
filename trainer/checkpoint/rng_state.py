"""The random number generators' states (Python, NumPy, torch CPU and CUDA), captured into a checkpoint and
restored from one, so that a resumed run draws the same numbers (dropout masks, data order) as an
uninterrupted one."""
from __future__ import annotations

import logging
import random

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng_state(cuda_by_rank: list[torch.Tensor] | None = None) -> dict:
    """Every generator's state, as tensors and plain values that torch.load(weights_only=True) reads back.
    Over several processes `cuda_by_rank` holds each rank's own GPU generator (own_cuda_rng_state): the
    process that writes sees only its own GPU's advance, the other GPUs' generators untouched."""
    numpy_state = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (numpy_state[0], torch.from_numpy(numpy_state[1].copy()),
                                                     *numpy_state[2:]),
             "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    if cuda_by_rank is not None:
        state["cuda_by_rank"] = cuda_by_rank
    return state


def own_cuda_rng_state() -> torch.Tensor | None:
    """The generator of this process's GPU (None without one)."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def restore_rng_state(state: dict, rank: int = 0, world_size: int = 1) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    by_rank = state.get("cuda_by_rank")
    if by_rank is not None and by_rank[0] is not None:
        if len(by_rank) == world_size:
            torch.cuda.set_rng_state(by_rank[rank])
        else:
            log.warning("checkpoint has the GPU RNG states of %d processes, this job runs %d: not restored "
                        "(dropout masks will differ)", len(by_rank), world_size)
    elif state["cuda"]:
        if len(state["cuda"]) != torch.cuda.device_count():
            log.warning("checkpoint has RNG states of %d GPUs, %d visible: CUDA RNG not restored (dropout "
                        "masks will differ)", len(state["cuda"]), torch.cuda.device_count())
        else:
            torch.cuda.set_rng_state_all(state["cuda"])
