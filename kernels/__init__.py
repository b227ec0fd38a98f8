"""The ops the model calls: rms_norm, layer_norm, rope, swiglu, linear_cross_entropy and adamw_update, each
dispatched by `kernels.dispatch` to its Triton kernel (`kernels/<op>_triton.py`) or to its plain PyTorch
contract in `kernels.reference`; and attention, run by the route that `kernels.attention` chooses
(`kernels.attention.attention(q, k, v, route)`).
"""
from kernels import attention, dispatch, reference
from kernels.dispatch import (adamw_update, get_backend, layer_norm, linear_cross_entropy, rms_norm, rope, set_backend,
                              swiglu)

__all__ = ["adamw_update", "attention", "dispatch", "get_backend", "layer_norm", "linear_cross_entropy", "reference",
           "rms_norm", "rope", "set_backend", "swiglu"]
