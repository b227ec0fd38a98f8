"""What the row-wise norms (`rms_norm.py`, `layer_norm.py`) share: input checks, launch shapes and the
backward kernel, which differs between them only in centering x.

Both norms keep whole rows in registers (BLOCK_H = next power of two of the hidden size), a tile of
BLOCK_R rows at a time: one row of a wide hidden size, several of a narrow one (QK-norm's rows of one head,
128 wide, would leave a one-row program mostly idle). The forward writes one fp32 statistic per row. The
backward, when it sums dweight (or dbias), lets a grid of a few programs per SM walk contiguous row ranges, each
summing its rows into one fp32 partial row; the partials are then added by `torch.sum` over the program axis,
so the reduction across rows runs in parallel instead of in one serial loop. Without a parameter gradient
(a frozen weight: LoRA) there is nothing to sum, and it runs one tile per program, as the forward does.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.rows import as_gradient_rows, as_rows

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A row lives in registers: past this the backward's four row-sized fp32 values per thread would spill.
MAX_HIDDEN = 32768
# Backward programs per SM: every count swept ran within the spread (docs/PERFORMANCE.md, "Kernels"); 2 keeps
# the fp32 partials smallest (4 MiB at [65536, 4096]).
BACKWARD_PROGRAMS_PER_SM = 2
# Elements of a tile of rows: rows narrower than this go several to a program (16 of 128), wider ones one.
ROW_TILE_ELEMENTS = 2048


def check_inputs(op: str, x: torch.Tensor, *params: torch.Tensor | None) -> None:
    """Clear errors for what the kernels cannot take; `params` are the per-feature weight/bias."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"{op}: x must have at least one row and a non-empty hidden dimension, got shape "
                         f"{tuple(x.shape)}")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {hidden} exceeds the supported maximum {MAX_HIDDEN}")
    for param in params:
        if param is None:
            continue
        if param.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: weight/bias must be a float tensor, got {param.dtype}")
        if param.shape != (hidden,) or param.stride(0) != 1:
            raise ValueError(f"{op}: weight/bias must be a contiguous [{hidden}] vector, got shape "
                             f"{tuple(param.shape)} stride {param.stride()}")
        if param.device != x.device:
            raise ValueError(f"{op}: weight/bias on {param.device} but x on {x.device}")


class RowTile(NamedTuple):
    block_h: int      # the hidden size's next power of two
    block_r: int      # rows a tile
    num_warps: int


def row_config(hidden: int, num_warps: int | None) -> RowTile:
    """A tile of whole rows, about ROW_TILE_ELEMENTS (one row if wider); unless given, warps for about 8 to 16
    elements per thread."""
    block_h = triton.next_power_of_2(hidden)
    block_r = max(1, ROW_TILE_ELEMENTS // block_h)
    return RowTile(block_h, block_r, num_warps if num_warps is not None else max(1, min(32, block_h * block_r // 512)))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def backward_grid(rows: int, device: torch.device, programs_per_sm: int, block_r: int = 1,
                  sums_parameters: bool = True) -> tuple[int, int]:
    """(programs, rows per program, a multiple of block_r) for the backward: a few programs per SM when they sum
    parameter gradients (the interpreter on CPU gets a small grid), else one tile each."""
    if not sums_parameters:
        return triton.cdiv(rows, block_r), block_r
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    programs = max(1, min(rows, sms * programs_per_sm))
    rows_per_program = triton.cdiv(triton.cdiv(rows, programs), block_r) * block_r
    return triton.cdiv(rows, rows_per_program), rows_per_program


def partial_buffer(programs: int, hidden: int, needed: bool, device: torch.device) -> torch.Tensor:
    """fp32 [programs, hidden] per-program partial sums, or a 1-element dummy the kernel never touches."""
    return torch.empty((programs, hidden) if needed else (1,), dtype=torch.float32, device=device)


def reduce_partials(partials: torch.Tensor, needed: bool, like: torch.Tensor | None) -> torch.Tensor | None:
    """Sum the per-program partials across programs (in parallel) into the parameter's dtype."""
    if not needed:
        return None
    return partials.sum(dim=0).to(like.dtype)


class ForwardLaunch(NamedTuple):
    x_rows: torch.Tensor   # x as [rows, hidden]
    y: torch.Tensor        # the output rows, x's dtype
    tile: RowTile
    programs: int          # one tile of rows each


def forward_launch(op: str, x: torch.Tensor, num_warps: int | None) -> ForwardLaunch:
    """x's rows, a fresh output and the launch configuration: one tile of rows per program."""
    x_rows = as_rows(op, "x", x)
    tile = row_config(x_rows.shape[1], num_warps)
    return ForwardLaunch(x_rows, torch.empty(x_rows.shape, dtype=x.dtype, device=x.device), tile,
                         triton.cdiv(x_rows.shape[0], tile.block_r))


@triton.jit
def _row_norm_backward_kernel(dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, w_ptr, mean_ptr, rstd_ptr,
                              dx_ptr, dw_partial_ptr, db_partial_ptr, n_rows, n_cols, rows_per_program,
                              BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, CENTERED: tl.constexpr,
                              COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr):
    """x_hat = (x - mean) * rstd for LayerNorm (CENTERED), x * rstd for RMSNorm;
    dx = rstd * (w*dy - x_hat * mean(w*dy*x_hat)), less rstd * mean(w*dy) when CENTERED. This program's
    rows (a tile of BLOCK_R at a time) sum dy*x_hat and dy into its own rows of dw_partial and db_partial."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    db = tl.zeros([BLOCK_H], dtype=tl.float32)
    first_row = program.to(tl.int64) * rows_per_program  # int64 row offsets: rows * hidden may pass 2^31
    end_row = tl.minimum(first_row + rows_per_program, n_rows)
    for tile_start in range(first_row, end_row, BLOCK_R):
        rows = tile_start + tl.arange(0, BLOCK_R)
        row_mask = rows < end_row
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=mask,
                     other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        if CENTERED:
            x_hat = tl.where(mask, (x - tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]) * rstd, 0.0)
        else:
            x_hat = x * rstd
        if COMPUTE_DX:
            w_dy = w[None, :] * dy
            projection = tl.sum(w_dy * x_hat, axis=1) / n_cols
            dx = w_dy - x_hat * projection[:, None]
            if CENTERED:
                dx = dx - (tl.sum(w_dy, axis=1) / n_cols)[:, None]
            tl.store(dx_ptr + rows[:, None] * n_cols + cols[None, :], (dx * rstd).to(dx_ptr.dtype.element_ty),
                     mask=mask)
        if COMPUTE_DW:
            dw += tl.sum(dy * x_hat, axis=0)
        if COMPUTE_DB:
            db += tl.sum(dy, axis=0)
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + program * n_cols + cols, dw, mask=col_mask)
    if COMPUTE_DB:
        tl.store(db_partial_ptr + program * n_cols + cols, db, mask=col_mask)


def backward(op: str, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             mean: torch.Tensor | None, rstd: torch.Tensor, needs: tuple[bool, bool, bool],
             num_warps: int | None, programs_per_sm: int):
    """(dx, dweight, dbias) of either norm, each None where `needs` (dx, dweight, dbias) says so; a mean
    (LayerNorm's) centers x. Unneeded outputs get a dummy the kernel's constexpr branches never touch."""
    compute_dx, compute_dw, compute_db = needs
    x_rows = as_rows(op, "x", x)
    dy_rows = as_gradient_rows(dy)
    n_rows, hidden = x_rows.shape
    tile = row_config(hidden, num_warps)
    programs, rows_per_program = backward_grid(n_rows, x.device, programs_per_sm, tile.block_r,
                                               compute_dw or compute_db)
    dx = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device) if compute_dx else rstd
    dw_partial = partial_buffer(programs, hidden, compute_dw, x.device)
    db_partial = partial_buffer(programs, hidden, compute_db, x.device)
    _row_norm_backward_kernel[(programs,)](
        dy_rows, dy_rows.stride(0), dy_rows.stride(1), x_rows, x_rows.stride(0), weight,
        rstd if mean is None else mean, rstd, dx, dw_partial, db_partial, n_rows, hidden, rows_per_program,
        BLOCK_R=tile.block_r, BLOCK_H=tile.block_h, CENTERED=mean is not None, COMPUTE_DX=compute_dx,
        COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, num_warps=tile.num_warps)
    return ((dx.view(x.shape) if compute_dx else None), reduce_partials(dw_partial, compute_dw, weight),
            reduce_partials(db_partial, compute_db, bias))
