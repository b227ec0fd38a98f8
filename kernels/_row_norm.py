"""Launcher pieces shared by the row-wise norms (`rmsnorm.py`, `layernorm.py`).

Both norms keep one whole row in registers (BLOCK_H = next power of two of the hidden size), write one
fp32 statistic per row in the forward, and in the backward let a grid of a few programs per SM walk
contiguous row ranges, each summing its rows' dweight (and dbias) into one fp32 partial row; the
partials are then added by `torch.sum` over the program axis, so the reduction across rows runs in
parallel instead of in one serial loop.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A row lives in registers: past this the backward's four row-sized fp32 values per thread would spill.
MAX_HIDDEN = 32768
# Backward programs per SM. On an H100 at [65536, 4096] bf16, 2 to 16 and 4 to 16 warps all ran
# fwd+bwd within 3% (scripts/bench_kernels.py --sweep); 2 keeps the fp32 partials smallest (4 MiB).
BACKWARD_PROGRAMS_PER_SM = 2


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


def as_rows(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """View `t` as [rows, hidden] with unit column stride and one row stride, without copying."""
    hidden = t.shape[-1]
    try:
        rows = t.view(-1, hidden)
    except RuntimeError:
        rows = None
    if rows is None or (hidden > 1 and rows.stride(1) != 1):
        raise ValueError(
            f"{op}: {name} of shape {tuple(t.shape)} and strides {t.stride()} is not a stack of dense "
            f"rows with one row stride; call .contiguous() on it if that copy is intended")
    return rows


def as_gradient_rows(grad: torch.Tensor) -> torch.Tensor:
    """The incoming gradient as [rows, hidden]; autograd may hand an expanded (stride 0) tensor, which
    the kernels read through its strides, so only an unflattenable layout is copied."""
    try:
        return grad.view(-1, grad.shape[-1])
    except RuntimeError:
        return grad.reshape(-1, grad.shape[-1])


def row_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) that hold one row with about 8 to 16 elements per thread."""
    block = triton.next_power_of_2(hidden)
    num_warps = max(1, min(32, block // 512))
    return block, num_warps


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def backward_grid(rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) for the backward; the interpreter on CPU gets a small grid."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    programs = max(1, min(rows, sms * BACKWARD_PROGRAMS_PER_SM))
    rows_per_program = triton.cdiv(rows, programs)
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
    block: int
    num_warps: int


def forward_launch(op: str, x: torch.Tensor) -> ForwardLaunch:
    """x's rows, a fresh output and the launch configuration: one program per row."""
    x_rows = as_rows(op, "x", x)
    block, num_warps = row_config(x_rows.shape[1])
    return ForwardLaunch(x_rows, torch.empty(x_rows.shape, dtype=x.dtype, device=x.device), block, num_warps)


class BackwardLaunch(NamedTuple):
    x_rows: torch.Tensor
    dy_rows: torch.Tensor
    dx: torch.Tensor       # fresh [rows, hidden], or a dummy the kernel's constexpr branch never writes
    block: int
    num_warps: int
    programs: int
    rows_per_program: int


def backward_launch(op: str, dy: torch.Tensor, x: torch.Tensor, compute_dx: bool,
                    dummy: torch.Tensor) -> BackwardLaunch:
    x_rows = as_rows(op, "x", x)
    n_rows, hidden = x_rows.shape
    block, num_warps = row_config(hidden)
    programs, rows_per_program = backward_grid(n_rows, x.device)
    dx = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device) if compute_dx else dummy
    return BackwardLaunch(x_rows, as_gradient_rows(dy), dx, block, num_warps, programs, rows_per_program)
