"""Triton's kernels run through its interpreter without a GPU and compiled with one (conftest_kernels
settles which, unless TRITON_INTERPRET says). Triton chooses when it is first imported, so that is set up
here, before any test module can import it."""
import conftest_kernels  # noqa: F401  (sets TRITON_INTERPRET and patches the interpreter)
