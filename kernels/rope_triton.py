"""Rotary position embedding of q and k in Triton, one launch each, in the rotate-half convention of
`reference.rope`: with x = (x1, x2) the two halves of a head and the tables' halves (c1, c2), (s1, s2),

    y1 = c1 * x1 - s1 * x2,    y2 = c2 * x2 + s2 * x1.

The backward applies the transposed rotation (dx1 = c1 * dy1 + s2 * dy2, dx2 = c2 * dy2 - s1 * dy1, the
inverse rotation for Llama's duplicated tables). Arithmetic is fp32 whatever the dtypes; q and k keep theirs.
The tables take no gradient; the forward saves only them.

Out of place both ways, by memory: the rotated q (1 GiB at 131k tokens) exists beside the unrotated one
only during the kernel, when the layer holds less than at its backward's peak (attention's inputs, outputs
and gradients); the unfused ops made several such tensors (products, cat, neg). Rotating in place would
save that transient but not the peak, and costs more than it saves: q and k are views of their
projections' outputs, and autograd turns an in-place write of a view into CopySlices and as_strided
backward nodes (several more full copies of the gradient). The incoming gradient is never written either:
it may be a tensor autograd shares with the caller (the `dy` of `y.backward(dy)`).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# All heads of a token are one block in registers; past this many elements per tensor they would spill.
MAX_HEADS_TIMES_DIM = 32768


@triton.jit
def _rope_kernel(x_ptr, x_batch_stride, x_seq_stride, x_head_stride, x_dim_stride, y_ptr, cos_ptr, sin_ptr,
                 table_batch_stride, table_seq_stride, seqlen, n_heads, half,
                 BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, TRANSPOSE: tl.constexpr):
    """One program per token: its tables' halves are loaded once and rotate all its heads of x (read
    through its strides: any layout, no copy) into the contiguous [B, S, heads, D] y."""
    token = tl.program_id(0).to(tl.int64)  # int64 offsets: tokens * heads * D passes 2^31 at 524k tokens
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half)
    batch, position = token // seqlen, token % seqlen
    table = batch * table_batch_stride + position * table_seq_stride + dims
    c1 = tl.load(cos_ptr + table, mask=dims < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + half, mask=dims < half, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=dims < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + half, mask=dims < half, other=0.0).to(tl.float32)
    x_first = (x_ptr + batch * x_batch_stride + position * x_seq_stride + heads * x_head_stride
               + dims * x_dim_stride)
    x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_first + half * x_dim_stride, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:
        y1 = c1 * x1 + s2 * x2
        y2 = c2 * x2 - s1 * x1
    else:
        y1 = c1 * x1 - s1 * x2
        y2 = c2 * x2 + s2 * x1
    y_first = y_ptr + (token * n_heads + heads) * (2 * half) + dims
    tl.store(y_first, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_first + half, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Clear errors for what the kernel cannot take (it reads q, k and the tables through their strides)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"rope: q and k must be [B, S, heads, D] with the same B, S and D, got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    batch, seqlen, _, head_dim = q.shape
    if head_dim % 2 or q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"rope: the head dim must be even and the tensors non-empty, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    if max(q.shape[2], k.shape[2]) * head_dim > MAX_HEADS_TIMES_DIM:
        raise ValueError(f"rope: heads * head dim exceeds the supported maximum {MAX_HEADS_TIMES_DIM}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"rope: {name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"rope: {name} on {t.device} but q on {q.device}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (batch, seqlen, 1, head_dim) or t.stride(3) != 1:
            raise ValueError(f"rope: {name} must be [{batch}, {seqlen}, 1, {head_dim}] with unit stride in the "
                             f"last dim, got shape {tuple(t.shape)} strides {t.stride()}")
        if t.requires_grad:
            raise ValueError(f"rope: the {name} table takes no gradient here; use kernels.reference.rope")
    if cos.stride() != sin.stride():
        raise ValueError(f"rope: cos and sin must share strides, got {cos.stride()} and {sin.stride()}")


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """A new contiguous tensor: x [B, S, H, D] rotated by the tables (transposed: the backward's rotation)."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    batch, seqlen, heads, head_dim = x.shape
    block_heads, block_half = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim // 2)
    _rope_kernel[(batch * seqlen,)](x, *x.stride(), y, cos, sin, cos.stride(0), cos.stride(1), seqlen, heads,
                                    head_dim // 2, BLOCK_HEADS=block_heads, BLOCK_HALF=block_half,
                                    TRANSPOSE=transpose, num_warps=max(1, min(8, block_heads * block_half // 512)))
    return y


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        _check_inputs(q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        return _rotated(q, cos, sin, transpose=False), _rotated(k, cos, sin, transpose=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotated(dq, cos, sin, transpose=True), _rotated(dk, cos, sin, transpose=True), None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rope`: q [B, S, Hq, D] and k [B, S, Hkv, D] rotated by the tables cos, sin [B, S, 1, D]."""
    return RopeFunction.apply(q, k, cos, sin)
