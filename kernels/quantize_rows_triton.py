"""Row-wise quantization to float8 e4m3 in Triton (`reference.quantize_rows`): the activations and gradients
that FP8 products read (model/fp8.py).

One program quantizes BLOCK_M rows in two sweeps over their columns: the first finds each row's largest
magnitude, the second divides by the row's scale and stores e4m3 (the rows are re-read from L2). So x is read
from memory once and written once at one byte an element, where PyTorch's eager ops (abs, amax, division,
clamp, cast) make five passes. An optional per-column fp32 scale multiplies x first: the backward folds the
weight's per-row scales into the gradient that way (model/fp8.py says why). A row holding inf or NaN gets a
NaN scale, so its products are NaN and nothing downstream mistakes it for a number.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_AMAX

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The fastest of the settings scripts/bench_fp8.py --sweep-quantizer timed on 4096- and 14336-wide rows.
BLOCK_M = 4
BLOCK_K = 2048
NUM_WARPS = 8


@triton.jit
def _round_to_e4m3(q):
    """fp32 q rounded to the nearest e4m3 value (ties to even), still in fp32. Hopper's conversion of fp32 to
    e4m3 (the PTX's cvt.rn.satfinite.e4m3x2.f32) rounds twice, through fp16 (37.99999 becomes 38.0, then the
    tie rounds to 40 where 36 is nearest); rounded here first, the conversion is exact. Normal e4m3 keeps 3
    mantissa bits: the low 20 of fp32's are rounded away on the bits. Subnormal e4m3 (below 2^-6) is a
    multiple of 2^-9: adding and subtracting 1.5 * 2^14, whose fp32 ulp is 2^-9, rounds to one; done on the
    magnitude, with q's sign bit put back after, so that what rounds to zero keeps its sign as the cast gives it
    (-0, not +0; Triton's negation is 0 - x, so the bit)."""
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(q) + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    subnormal = (magnitude | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(q) < 0.015625, subnormal, normal)


@triton.jit
def _load_columns(x_ptr, x_row_stride, column_scale_ptr, rows, row_mask, start, n_cols,
                  HAS_COLUMN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns [start, start + BLOCK_K) of the program's rows in fp32, times their column scales if any; with
    their column indices and mask."""
    cols = start + tl.arange(0, BLOCK_K)
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_COLUMN_SCALE:
        x = x * tl.load(column_scale_ptr + cols, mask=cols < n_cols, other=0.0)[None, :]
    return x, cols, mask


@triton.jit
def _quantize_rows_kernel(x_ptr, x_row_stride, column_scale_ptr, q_ptr, scale_ptr, n_rows, n_cols,
                          FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, HAS_COLUMN_SCALE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)     # int64 offsets: rows * columns passes 2^31 at 524k x 4096
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    poison = tl.zeros([BLOCK_M], dtype=tl.float32)      # NaN where a row holds inf or NaN (x * 0)
    for start in range(0, n_cols, BLOCK_K):
        x, cols, mask = _load_columns(x_ptr, x_row_stride, column_scale_ptr, rows, row_mask, start, n_cols,
                                      HAS_COLUMN_SCALE, BLOCK_K)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        poison += tl.sum(x * 0.0, axis=1)
    # IEEE divisions (a plain / compiles to an approximate one): the reference's scales and quotients
    scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX) + poison
    for start in range(0, n_cols, BLOCK_K):
        x, cols, mask = _load_columns(x_ptr, x_row_stride, column_scale_ptr, rows, row_mask, start, n_cols,
                                      HAS_COLUMN_SCALE, BLOCK_K)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + rows[:, None] * n_cols + cols[None, :], _round_to_e4m3(q).to(q_ptr.dtype.element_ty),
                 mask=mask)
    tl.store(scale_ptr + rows, scale, mask=row_mask)


def quantize_rows(x: torch.Tensor, column_scale: torch.Tensor | None = None,
                  block_m: int = BLOCK_M, block_k: int = BLOCK_K,
                  num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows may be strided, columns contiguous) as e4m3 [M, K] and fp32 row scales [M]; see
    `reference.quantize_rows`."""
    if x.dtype not in SUPPORTED_DTYPES or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows: x must be a 2-D float32/float16/bfloat16 tensor with contiguous rows, "
                         f"got {x.dtype} of shape {tuple(x.shape)} and strides {x.stride()}")
    rows, cols = x.shape
    if column_scale is not None and (column_scale.shape != (cols,) or column_scale.dtype != torch.float32):
        raise ValueError(f"quantize_rows: column_scale must be fp32 of shape ({cols},), got "
                         f"{column_scale.dtype} of shape {tuple(column_scale.shape)}")
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(triton.cdiv(rows, block_m),)](
            x, x.stride(0), x if column_scale is None else column_scale, q, scale, rows, cols,
            FP8_MAX=FP8_MAX, MIN_AMAX=FP8_MIN_AMAX, HAS_COLUMN_SCALE=column_scale is not None,
            BLOCK_M=block_m, BLOCK_K=block_k, num_warps=num_warps)
    return q, scale
