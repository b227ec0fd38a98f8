"""A 2-D transpose in Triton (`reference.transpose`), for the one-byte FP8 weights the backward's product reads
transposed (model/fp8.py): PyTorch's strided copy moves float8 at a small fraction of the memory bandwidth
(docs/PERFORMANCE.md, "FP8 for the frozen base"). One program moves a BLOCK x BLOCK tile; Triton routes the
transposition through shared memory, so loads and stores both run along contiguous rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64
NUM_WARPS = 4


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, n_rows, n_cols, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tile = tl.load(x_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask)
    tl.store(y_ptr + cols.to(tl.int64)[:, None] * n_rows + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose(x: torch.Tensor, block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """x [R, C], contiguous, as a new contiguous [C, R] tensor of its dtype (moved as bytes when one byte wide)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"transpose: x must be a contiguous 2-D tensor, got shape {tuple(x.shape)} and strides "
                         f"{x.stride()}")
    rows, cols = x.shape
    y = torch.empty(cols, rows, dtype=x.dtype, device=x.device)
    one_byte = x.element_size() == 1          # float8 moves as uint8: the same bytes, a type every backend takes
    source, target = (x.view(torch.uint8), y.view(torch.uint8)) if one_byte else (x, y)
    if x.numel():
        _transpose_kernel[(triton.cdiv(rows, block), triton.cdiv(cols, block))](
            source, target, rows, cols, BLOCK=block, num_warps=num_warps)
    return y
