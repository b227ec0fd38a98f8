"""The ops the model calls (rms_norm, layer_norm, rope, attention, swiglu, linear_cross_entropy,
adamw_update), each dispatched by `kernels.dispatch` to its Triton kernel (`kernels/<op>.py`, attention in
`kernels/flash_attention.py`, or cuDNN's in `kernels/cudnn_attention.py`) or to its plain PyTorch
contract in `kernels.reference`.

Importing a submodule binds its name on the package, so loading `kernels.rms_norm` (the Triton module)
would replace the package's `rms_norm` (the dispatching function). The Triton modules load lazily, on
first use, so binding the functions after them here would not hold; instead the package's module class
refuses that one rebinding: `kernels.rms_norm` is always the function, whoever imported what. The Triton
function is `from kernels.rms_norm import rms_norm`, the module `importlib.import_module("kernels.rms_norm")`
(`import kernels.rms_norm as m` reads the package attribute: the dispatching function).
"""
from __future__ import annotations

import sys
import types

from kernels import dispatch, reference
from kernels.dispatch import (adamw_update, attention, attention_kernels, attention_records, get_backend,
                              layer_norm, linear_cross_entropy, rms_norm, rope, set_backend, set_sequence_parallel,
                              swiglu)


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if name in dispatch.TRITON_OPS and isinstance(value, types.ModuleType):
            return  # a Triton module of an op's name: it stays reachable through sys.modules
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
