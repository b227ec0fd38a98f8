"""SwiGLU in Triton: y = silu(gate) * up, elementwise, for Llama's MLP (`reference.swiglu`).

One pass each way instead of PyTorch's silu kernel and product (and, in the backward, the product's two
gradients and silu's): the forward saves only gate and up and the backward recomputes sigmoid(gate) from
gate. With s = sigmoid(g): dgate = dy * up * s * (1 + g * (1 - s)), dup = dy * g * s. Arithmetic is fp32
whatever the dtype (bf16 under autocast); outputs and gradients have the inputs' dtype. The gradients go to
fresh tensors, not into gate's and up's memory, so a retained graph can run its backward again.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import triton
import triton.language as tl

from kernels import rows

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Columns per program and warps (the defaults of `swiglu`'s keyword arguments): 8 elements (16 bytes of
# bf16) per thread; 1024 divides Llama-3 8B's 14336.
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _swiglu_forward_kernel(gate_ptr, gate_row_stride, up_ptr, up_row_stride, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: rows * columns passes 2^31 at 131k x 14336
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(dy_ptr, dy_row_stride, dy_col_stride, gate_ptr, gate_row_stride, up_ptr, up_row_stride,
                            dgate_ptr, dup_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    dgate = dy * up * (sigmoid + silu * (1.0 - sigmoid))
    tl.store(dgate_ptr + row * n_cols + cols, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + row * n_cols + cols, (dy * silu).to(dup_ptr.dtype.element_ty), mask=mask)


def _check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.dtype not in SUPPORTED_DTYPES or up.dtype != gate.dtype:
        raise TypeError(f"swiglu: gate and up must share one of float32, float16, bfloat16, got {gate.dtype} "
                        f"and {up.dtype}")
    if gate.shape != up.shape or gate.dim() < 1 or gate.numel() == 0:
        raise ValueError(f"swiglu: gate and up must have one non-empty shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if up.device != gate.device:
        raise ValueError(f"swiglu: up on {up.device} but gate on {gate.device}")


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, block: int, num_warps: int) -> torch.Tensor:
        _check_inputs(gate, up)
        gate_rows, up_rows = rows.as_rows("swiglu", "gate", gate), rows.as_rows("swiglu", "up", up)
        y = torch.empty(gate_rows.shape, dtype=gate.dtype, device=gate.device)
        ctx.grid = (gate_rows.shape[0], triton.cdiv(gate_rows.shape[1], block))
        ctx.launch = dict(BLOCK=block, num_warps=num_warps)
        _swiglu_forward_kernel[ctx.grid](gate_rows, gate_rows.stride(0), up_rows, up_rows.stride(0), y,
                                         gate_rows.shape[1], **ctx.launch)
        ctx.save_for_backward(gate, up)
        return y.view(gate.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        gate_rows, up_rows = rows.as_rows("swiglu", "gate", gate), rows.as_rows("swiglu", "up", up)
        dy_rows = rows.as_gradient_rows(dy)
        dgate = torch.empty(gate_rows.shape, dtype=gate.dtype, device=gate.device)
        dup = torch.empty_like(dgate)
        _swiglu_backward_kernel[ctx.grid](
            dy_rows, dy_rows.stride(0), dy_rows.stride(1), gate_rows, gate_rows.stride(0), up_rows, up_rows.stride(0),
            dgate, dup, gate_rows.shape[1], **ctx.launch)
        return dgate.view(gate.shape), dup.view(up.shape), None, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """silu(gate) * up for gate and up of one shape and dtype (rows of unit column stride, any row stride,
    e.g. the two halves of one fused projection); same contract as `reference.swiglu`. block (columns per
    program, a power of two) and num_warps tune the launches."""
    return SwiGLUFunction.apply(gate, up, block, num_warps)
