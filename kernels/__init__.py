"""The ops the model calls, dispatched to Triton kernels on CUDA and to `kernels.reference` elsewhere.

Backends: "auto" (Triton where the tensor is on CUDA and a kernel exists for it, e.g. attention only for
head dims 64 and 128, else the reference),
"triton" (Triton or a clear error), "reference" (always the plain PyTorch ops). `TRITON_INTERPRET=1`
lets "triton" run the kernels on CPU tensors through Triton's interpreter (tests do this).

The Triton files are named unlike the functions (rmsnorm.py, not rms_norm.py): importing a submodule
binds its name on this package, which would shadow the dispatching function of the same name.
"""
from __future__ import annotations

import importlib
import os

import torch

from kernels import reference

BACKENDS = ("auto", "triton", "reference")
# op name -> (module, function) of its Triton implementation.
TRITON_OPS = {
    "rms_norm": ("kernels.rmsnorm", "rms_norm"),
    "layer_norm": ("kernels.layernorm", "layer_norm"),
    "linear_cross_entropy": ("kernels.fused_linear_ce", "linear_cross_entropy"),
    "attention": ("kernels.flash_attention", "flash_attention"),
    "adamw_update": ("kernels.adamw", "adamw_update"),
}
_backend = "auto"


def set_backend(name: str) -> None:
    """Choose how ops dispatch; "triton" without CUDA is an error unless TRITON_INTERPRET=1."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernels backend must be one of {BACKENDS}, got {name!r}")
    check_available(name)
    _backend = name


def check_available(name: str) -> None:
    """RuntimeError when backend `name` cannot run on this machine (Triton without CUDA or interpreter)."""
    if name == "triton" and not (torch.cuda.is_available() or interpreting()):
        raise RuntimeError(
            "kernels=triton needs a CUDA GPU (or TRITON_INTERPRET=1 to run the kernels slowly on CPU); "
            "use kernels=auto or kernels=reference on this machine")


def get_backend() -> str:
    return _backend


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_op(name: str):
    module_name, function_name = TRITON_OPS[name]
    return getattr(importlib.import_module(module_name), function_name)


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


def attention(q, k, v, causal=True, cu_seqlens=None, softmax_scale=None):
    op = _pick("attention", q)
    if _backend == "auto" and op is not reference.attention and not _triton_supports_attention(q):
        op = reference.attention     # e.g. the tiny model's head dim 16 on a GPU
    return op(q, k, v, causal=causal, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)


def _triton_supports_attention(q) -> bool:
    return importlib.import_module("kernels.flash_attention").supports(q)


def attention_records(backend: str, device_type: str, head_dim: int) -> bool:
    """Whether attention under `backend` on `device_type` records on an AttentionTape: only the Triton
    attention does, so keeping attention outputs helps only where it runs."""
    if backend == "reference":
        return False
    supported = head_dim in importlib.import_module("kernels.flash_attention").SUPPORTED_HEAD_DIMS
    return supported and (backend == "triton" or device_type == "cuda")


def linear_cross_entropy(hidden, weight, targets, ignore_index=-100, reduction="mean"):
    return _pick("linear_cross_entropy", hidden)(hidden, weight, targets, ignore_index=ignore_index,
                                                 reduction=reduction)


def adamw_update(param, grad, exp_avg, exp_avg_sq, **hyperparameters):
    """In-place fused AdamW step with stochastic rounding of bf16 state (reference.adamw_update)."""
    _pick("adamw_update", param)(param, grad, exp_avg, exp_avg_sq, **hyperparameters)
