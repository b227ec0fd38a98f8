"""What the attention kernels take, free of Triton: kernels/attention/route.py asks these when it chooses (the
planner too, before anything is built), and importing Triton fixes its choice of interpreter or compiler for the
process, which must stay the caller's. Where they run: conf.capability."""
from __future__ import annotations

import torch

# The Triton kernels (kernels/attention/flash_attention.py); under kernels=auto other shapes run the reference.
TRITON_HEAD_DIMS = (64, 128)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_takes(head_dim: int, dtype: torch.dtype | None) -> bool:
    """Whether the Triton kernels take this head dim and dtype (None: any dtype they take)."""
    return head_dim in TRITON_HEAD_DIMS and (dtype is None or dtype in TRITON_DTYPES)


def tma_compatible(t: torch.Tensor) -> bool:
    """Tensor descriptors need a contiguous last dim and 16-byte aligned base and strides."""
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all(s * t.element_size() % 16 == 0 and s > 0 for s in t.stride()[:3]))
