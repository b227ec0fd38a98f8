"""Import first in a test module that runs Triton kernels: it settles, once for the session, whether they
run through Triton's interpreter (on CPU tensors) or compiled (on the GPU).

`triton.jit` picks interpreter or compiler when a kernel module is imported, so TRITON_INTERPRET must be
set before any `kernels.*` Triton module loads; tests/conftest.py imports this helper before any test module.
A TRITON_INTERPRET already set stays; unset, it is 1 without a GPU and 0 with one. One module that turned
the interpreter on in a GPU session would run every later kernel interpreted, on CUDA tensors too (a
512-token attention test then ran for minutes on the H100, as if hung); tests that need the interpreter
skip instead (`needs_interpreter`).
It also carries the fix of triton-lang/triton#9171 (triton 3.6 with numpy >= 2.4: a loop bound that is a
kernel argument fails with "only 0-dimensional arrays can be converted to Python scalars").
"""
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import triton.runtime.interpreter as _interpreter  # noqa: E402

if not getattr(_interpreter, "_scalar_index_fixed", False):
    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor_with_scalar_index(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        # Interpreter scalars are 1-element arrays, which numpy >= 2.4 no longer turns into an int.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor_with_scalar_index
    _interpreter._scalar_index_fixed = True


import pytest  # noqa: E402

# A test that runs Triton kernels on CPU tensors: compiled Triton (a GPU session) cannot, and tests/*_gpu.py
# cover the kernels there.
needs_interpreter = pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1",
                                       reason="runs Triton on CPU tensors: needs TRITON_INTERPRET=1")
# A test of the compiled kernels on CUDA tensors.
needs_compiled_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ["TRITON_INTERPRET"] == "1",
                                        reason="needs a CUDA GPU and compiled (not interpreted) Triton")


@pytest.fixture
def poisoned_empty():
    """Make torch.empty & co. return NaN-filled memory, so an output element a kernel never writes fails
    the comparison instead of passing as leftover zeros."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
