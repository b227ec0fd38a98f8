"""The ops the model calls: rms_norm, layer_norm, rope, swiglu, linear_cross_entropy, adamw_update and FP8's
quantize_rows, transpose and scaled_matmul (model/fp8.py), each dispatched by `kernels.dispatch` to its Triton kernel
(`kernels/<op>_triton.py`; cuBLAS for scaled_matmul) or to its plain PyTorch contract in `kernels.reference`;
and attention, run by the route that `kernels.attention` chooses (`kernels.attention.attention(q, k, v, route)`).
"""
from kernels import attention, dispatch, reference
from kernels.dispatch import (adamw_update, get_backend, layer_norm, linear_cross_entropy, quantize_rows, rms_norm,
                              rope, scaled_matmul, set_backend, swiglu, transpose)

__all__ = ["adamw_update", "attention", "dispatch", "get_backend", "layer_norm", "linear_cross_entropy",
           "quantize_rows", "reference", "rms_norm", "rope", "scaled_matmul", "set_backend", "swiglu", "transpose"]
