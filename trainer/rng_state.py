"""The random number generators' states (Python, NumPy, torch CPU and CUDA), captured into a checkpoint and
restored from one, so that a resumed run draws the same numbers (dropout masks, data order) as an
uninterrupted one."""
from __future__ import annotations

import logging
import random

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng_state() -> dict:
    """Every generator's state, as tensors and plain values that torch.load(weights_only=True) reads back."""
    numpy_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": (numpy_state[0], torch.from_numpy(numpy_state[1].copy()),
                                                    *numpy_state[2:]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            log.warning("checkpoint has RNG states of %d GPUs, %d visible: CUDA RNG not restored (dropout "
                        "masks will differ)", len(state["cuda"]), torch.cuda.device_count())
        else:
            torch.cuda.set_rng_state_all(state["cuda"])
