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
def _rms_norm_forward_kernel(x_ptr, x_row_stride, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps,
                             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      num_warps: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    launch = _row_norm.forward_launch("rms_norm", x, num_warps)
    n_rows, hidden = launch.x_rows.shape
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    _rms_norm_forward_kernel[(launch.programs,)](launch.x_rows, launch.x_rows.stride(0), weight, launch.y, rstd, n_rows,
                                                 hidden, eps, BLOCK_R=launch.tile.block_r, BLOCK_H=launch.tile.block_h,
                                                 num_warps=launch.tile.num_warps)
    return launch.y.view(x.shape), rstd


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, num_warps: int | None,
                backward_programs_per_sm: int) -> torch.Tensor:
        _row_norm.check_inputs("rms_norm", x, weight)
        y, rstd = _rms_norm_forward(x, weight, eps, num_warps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.launch = (num_warps, backward_programs_per_sm)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], False)
        dx, dw, _ = _row_norm.backward("rms_norm", dy, x, weight, None, None, rstd, needs, *ctx.launch)
        return dx, dw, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, num_warps: int | None = None,
             backward_programs_per_sm: int = _row_norm.BACKWARD_PROGRAMS_PER_SM) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape); same contract as `reference.rms_norm`.
    num_warps (per row; default by hidden size) and backward_programs_per_sm tune the launches."""
    return RMSNormFunction.apply(x, weight, eps, num_warps, backward_programs_per_sm)
