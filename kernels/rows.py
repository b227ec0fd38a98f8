"""Tensors seen as [rows, width] without copying, for the kernels that walk rows (the norms, SwiGLU) and for
FP8's row quantization (model/fp8.py). Plain PyTorch: importing it loads no Triton."""
from __future__ import annotations

import torch


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
