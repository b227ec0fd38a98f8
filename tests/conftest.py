"""Without a GPU the Triton kernels run through Triton's interpreter. Triton chooses interpreter or
compiler when it is first imported, so that is set up here, before any test module can import it."""
import torch

if not torch.cuda.is_available():
    import conftest_kernels  # noqa: F401  (sets TRITON_INTERPRET=1 and patches the interpreter)
