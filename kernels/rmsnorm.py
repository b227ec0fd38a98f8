"""RMSNorm in Triton: y = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps) over the last dim.

Statistics and arithmetic are fp32 whatever the input dtype; y has x's dtype (as `reference.rms_norm`).
The forward saves only the fp32 rstd of each row; the backward recomputes x_hat = x * rstd from x.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import triton
import triton.language as tl

from kernels import _row_norm


@triton.jit
def _rms_norm_forward_kernel(x_ptr, x_row_stride, w_ptr, y_ptr, rstd_ptr, n_cols, eps,
                             BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * n_cols + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, w_ptr, rstd_ptr,
                              dx_ptr, dw_partial_ptr, n_rows, n_cols, rows_per_program,
                              BLOCK_H: tl.constexpr, COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr):
    """dx = rstd * (w*dy - x_hat * mean(w*dy*x_hat)); this program's rows' sum of dy*x_hat goes to
    its own row of dw_partial."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    first_row = program.to(tl.int64) * rows_per_program  # int64 row offsets: rows * hidden may pass 2^31
    for row in range(first_row, min(first_row + rows_per_program, n_rows)):
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        if COMPUTE_DX:
            w_dy = w * dy
            projection = tl.sum(w_dy * x_hat, axis=0) / n_cols
            dx = (w_dy - x_hat * projection) * rstd
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw += dy * x_hat
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + program * n_cols + cols, dw, mask=mask)


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    launch = _row_norm.forward_launch("rms_norm", x)
    n_rows, hidden = launch.x_rows.shape
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    _rms_norm_forward_kernel[(n_rows,)](launch.x_rows, launch.x_rows.stride(0), weight, launch.y, rstd, hidden,
                                        eps, BLOCK_H=launch.block, num_warps=launch.num_warps)
    return launch.y.view(x.shape), rstd


def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                       compute_dx: bool, compute_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    launch = _row_norm.backward_launch("rms_norm", dy, x, compute_dx, dummy=rstd)
    n_rows, hidden = launch.x_rows.shape
    dw_partial = _row_norm.partial_buffer(launch.programs, hidden, compute_dw, x.device)
    _rms_norm_backward_kernel[(launch.programs,)](
        launch.dy_rows, launch.dy_rows.stride(0), launch.dy_rows.stride(1), launch.x_rows, launch.x_rows.stride(0),
        weight, rstd, launch.dx, dw_partial, n_rows, hidden, launch.rows_per_program,
        BLOCK_H=launch.block, COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, num_warps=launch.num_warps)
    return ((launch.dx.view(x.shape) if compute_dx else None),
            _row_norm.reduce_partials(dw_partial, compute_dw, weight))


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _row_norm.check_inputs("rms_norm", x, weight)
        y, rstd = _rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _rms_norm_backward(dy, x, weight, rstd, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape); same contract as `reference.rms_norm`."""
    return RMSNormFunction.apply(x, weight, eps)
