"""Triton's kernels run through its interpreter without a GPU and compiled with one (conftest_kernels
settles which, unless TRITON_INTERPRET says). Triton chooses when it is first imported, so that is set up
here, before any test module can import it."""
import os

import conftest_kernels  # noqa: F401  (sets TRITON_INTERPRET and patches the interpreter)
import torch

# Under pytest-xdist (`make test` runs two workers) each worker takes one intra-op thread: workers with
# a thread per core each would spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
