"""Which implementation each op other than attention runs: its Triton kernel or `kernels.reference`.
(Attention runs the route kernels/attention/route.py chooses, which reads this backend where no build
installed a route.)

Backends: "auto" (Triton where the tensor is on CUDA, else the reference), "triton" (Triton or a clear
error), "reference" (always the plain PyTorch ops). `TRITON_INTERPRET=1` lets "triton" run the kernels on
CPU tensors through Triton's interpreter (tests do this). Set once per job, by trainer.loop.train.

The Triton modules are imported on first use, not here: `import kernels` must work before the tests
choose interpreter or compiler (Triton decides when it is first imported) and on machines without Triton.
"""
from __future__ import annotations

import importlib

import torch

from conf.schema.job import check_kernels_backend
import kernels.reference as reference

# The ops with a Triton twin: each lives in `kernels/<op>_triton.py` as a function of the op's name.
TRITON_OPS = ("rms_norm", "layer_norm", "linear_cross_entropy", "adamw_update", "rope", "swiglu", "quantize_rows",
              "transpose")

_backend = "auto"


def set_backend(name: str) -> None:
    """Choose how ops dispatch; "triton" without CUDA is an error unless TRITON_INTERPRET=1."""
    global _backend
    check_kernels_backend(name)
    _backend = name


def get_backend() -> str:
    return _backend


def _triton_op(name: str):
    return getattr(importlib.import_module(f"kernels.{name}_triton"), name)


def _pick(name: str, tensor: torch.Tensor):
    if _backend == "reference":
        return getattr(reference, name)
    if _backend == "triton" or tensor.is_cuda:
        return _triton_op(name)
    return getattr(reference, name)


def rms_norm(x, weight, eps):
    return _pick("rms_norm", x)(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    return _pick("layer_norm", x)(x, weight, bias, eps)


def rope(q, k, cos, sin):
    """New (q, k) rotated by the per-token tables (reference.rope), out of place on either backend."""
    return _pick("rope", q)(q, k, cos, sin)


def swiglu(gate, up):
    return _pick("swiglu", gate)(gate, up)


def linear_cross_entropy(hidden, weight, targets, ignore_index=-100, reduction="mean"):
    return _pick("linear_cross_entropy", hidden)(hidden, weight, targets, ignore_index=ignore_index,
                                                 reduction=reduction)


def adamw_update(param, grad, exp_avg, exp_avg_sq, **hyperparameters):
    """In-place fused AdamW step with stochastic rounding of bf16 state (reference.adamw_update)."""
    _pick("adamw_update", param)(param, grad, exp_avg, exp_avg_sq, **hyperparameters)


def quantize_rows(x, column_scale=None):
    """x [M, K] (times column_scale [K]) as e4m3 with one fp32 scale per row (reference.quantize_rows)."""
    return _pick("quantize_rows", x)(x, column_scale)


def transpose(x):
    """x [R, C] as a new contiguous [C, R] tensor (reference.transpose)."""
    return _pick("transpose", x)(x)


def scaled_matmul(a, a_scale, b, b_scale, out_dtype, fast_accumulation: bool = False):
    """The product of two row-quantized e4m3 operands over their last dimension (reference.scaled_matmul):
    cuBLAS's FP8 product on CUDA (`torch._scaled_mm`, row-wise scales), the reference elsewhere or with the
    reference backend. `fast_accumulation`: Hopper's FP8 accumulator without cuBLAS's periodic promotion to
    fp32, faster and slightly less exact (model/fp8.py takes it for the forward only, as torchao.float8 does)."""
    if _backend == "reference" or not a.is_cuda:
        return reference.scaled_matmul(a, a_scale, b, b_scale, out_dtype)
    # cuBLAS takes b column-major: b [N, K] row-major, transposed, is that without a copy.
    return torch._scaled_mm(a, b.t(), scale_a=a_scale.view(-1, 1), scale_b=b_scale.view(1, -1), out_dtype=out_dtype,
                            use_fast_accum=fast_accumulation)
