"""What the attention kernels take and where they run, free of Triton: kernels/attention/route.py asks these
when it chooses (the planner too, before anything is built), and importing Triton fixes its choice of
interpreter or compiler for the process, which must stay the caller's."""
from __future__ import annotations

import os

import torch

from conf.schema.job import triton_interpreting

# The Triton kernels (kernels/attention/flash_attention.py); under kernels=auto other shapes run the reference.
TRITON_HEAD_DIMS = (64, 128)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_takes(head_dim: int, dtype: torch.dtype | None) -> bool:
    """Whether the Triton kernels take this head dim and dtype (None: any dtype they take)."""
    return head_dim in TRITON_HEAD_DIMS and (dtype is None or dtype in TRITON_DTYPES)


def runs_hopper_code(device: torch.device) -> bool:
    """A Hopper GPU whose kernels Triton compiles for Hopper, where the Gluon kernels run. TRITON_OVERRIDE_ARCH=sm80
    (the A100's code on this GPU) leaves the attention to the Triton kernels, as on an A100, and so does
    Triton's interpreter (TRITON_INTERPRET=1), which cannot run Gluon kernels."""
    override = os.environ.get("TRITON_OVERRIDE_ARCH", "")
    return (device.type == "cuda" and not triton_interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9 and override in ("", "sm90", "sm90a"))


def tma_compatible(t: torch.Tensor) -> bool:
    """Tensor descriptors need a contiguous last dim and 16-byte aligned base and strides."""
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all(s * t.element_size() % 16 == 0 and s > 0 for s in t.stride()[:3]))
