"""LayerNorm in Triton: y = (x - mean) * rstd * weight + bias over the last dim (bias optional).

Statistics and arithmetic are fp32 whatever the input dtype; y has x's dtype (as `reference.layer_norm`).
The forward saves the fp32 mean and rstd of each row; the backward recomputes x_hat from x.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import triton
import triton.language as tl

from kernels import _row_norm


@triton.jit
def _layer_norm_forward_kernel(x_ptr, x_row_stride, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps,
                               BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    y = centered * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_backward_kernel(dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, w_ptr, mean_ptr,
                                rstd_ptr, dx_ptr, dw_partial_ptr, db_partial_ptr, n_rows, n_cols,
                                rows_per_program, BLOCK_H: tl.constexpr, COMPUTE_DX: tl.constexpr,
                                COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr):
    """dx = rstd * (w*dy - x_hat * mean(w*dy*x_hat) - mean(w*dy)); this program's rows' sums of dy*x_hat
    and dy go to its own rows of dw_partial and db_partial."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    db = tl.zeros([BLOCK_H], dtype=tl.float32)
    first_row = program.to(tl.int64) * rows_per_program  # int64 row offsets: rows * hidden may pass 2^31
    for row in range(first_row, min(first_row + rows_per_program, n_rows)):
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        if COMPUTE_DX:
            w_dy = w * dy
            projection = tl.sum(w_dy * x_hat, axis=0) / n_cols
            dx = (w_dy - x_hat * projection - tl.sum(w_dy, axis=0) / n_cols) * rstd
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw += dy * x_hat
        if COMPUTE_DB:
            db += dy
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + program * n_cols + cols, dw, mask=mask)
    if COMPUTE_DB:
        tl.store(db_partial_ptr + program * n_cols + cols, db, mask=mask)


def _layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    launch = _row_norm.forward_launch("layer_norm", x)
    n_rows, hidden = launch.x_rows.shape
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    # Without a bias the kernel's HAS_BIAS branch never reads b_ptr; the weight stands in.
    _layer_norm_forward_kernel[(n_rows,)](
        launch.x_rows, launch.x_rows.stride(0), weight, weight if bias is None else bias, launch.y, mean, rstd,
        hidden, eps, BLOCK_H=launch.block, HAS_BIAS=bias is not None, num_warps=launch.num_warps)
    return launch.y.view(x.shape), mean, rstd


def _layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         mean: torch.Tensor, rstd: torch.Tensor, compute_dx: bool, compute_dw: bool,
                         compute_db: bool):
    launch = _row_norm.backward_launch("layer_norm", dy, x, compute_dx, dummy=rstd)
    n_rows, hidden = launch.x_rows.shape
    dw_partial = _row_norm.partial_buffer(launch.programs, hidden, compute_dw, x.device)
    db_partial = _row_norm.partial_buffer(launch.programs, hidden, compute_db, x.device)
    _layer_norm_backward_kernel[(launch.programs,)](
        launch.dy_rows, launch.dy_rows.stride(0), launch.dy_rows.stride(1), launch.x_rows, launch.x_rows.stride(0),
        weight, mean, rstd, launch.dx, dw_partial, db_partial, n_rows, hidden, launch.rows_per_program,
        BLOCK_H=launch.block, COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
        num_warps=launch.num_warps)
    return ((launch.dx.view(x.shape) if compute_dx else None),
            _row_norm.reduce_partials(dw_partial, compute_dw, weight),
            _row_norm.reduce_partials(db_partial, compute_db, bias))


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        _row_norm.check_inputs("layer_norm", x, weight, bias)
        y, mean, rstd = _layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        needs_dx, needs_dw, needs_db = ctx.needs_input_grad[:3]
        dx, dw, db = _layer_norm_backward(dy, x, weight, bias, mean, rstd, needs_dx, needs_dw,
                                          needs_db and bias is not None)
        return dx, dw, db, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension of x (any leading shape); same contract as `reference.layer_norm`."""
    return LayerNormFunction.apply(x, weight, bias, eps)
