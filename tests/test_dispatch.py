"""Op dispatch (all ops but attention, whose route tests/test_attention_route.py tests): reference on CPU,
Triton on request, and a clear error when Triton cannot run."""
import importlib
import os
import subprocess
import sys
import types

import pytest
import torch

import kernels
from conf.errors import ConfigError
from kernels import dispatch


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    kernels.set_backend("auto")


def test_cpu_tensors_use_the_reference_under_auto():
    x = torch.randn(3, 8)
    kernels.set_backend("auto")
    assert dispatch._pick("rms_norm", x) is kernels.reference.rms_norm


def test_triton_without_cuda_or_interpreter_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="kernels=triton needs a CUDA GPU"):
        kernels.set_backend("triton")


def test_triton_dispatches_to_the_kernel(monkeypatch):
    """Under the interpreter without a GPU; with one, as the session compiles: a Triton module first imported
    under TRITON_INTERPRET=1 would stay interpreted for every later test of the process."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.set_backend("triton")
    assert dispatch._pick("rms_norm", torch.randn(1)) is dispatch._triton_op("rms_norm")


def test_unknown_backend_is_rejected():
    with pytest.raises(ConfigError, match="is not one of"):
        kernels.set_backend("cuda")


@pytest.mark.parametrize("name", dispatch.TRITON_OPS)
def test_every_op_has_a_reference_and_a_triton_kernel(name):
    assert callable(getattr(kernels.reference, name))
    assert callable(dispatch._triton_op(name))


def test_the_package_attributes_stay_the_dispatching_functions_after_the_kernel_modules_load():
    """The Triton modules have names of their own (`kernels/<op>_triton.py`): loading them binds those names on
    the package, never the ops' (and the package is a plain module, with no hook against rebinding)."""
    import kernels.rms_norm_triton
    for name in dispatch.TRITON_OPS:
        importlib.import_module(f"kernels.{name}_triton")
    for name in dispatch.TRITON_OPS:
        assert getattr(kernels, name) is getattr(dispatch, name)
    assert type(sys.modules["kernels"]) is types.ModuleType
    assert kernels.rms_norm_triton.rms_norm is not kernels.rms_norm


def test_importing_the_model_and_the_dispatch_leaves_triton_unimported():
    """Triton chooses interpreter or compiler when it is first imported, and a kernel module's `triton.jit`
    when it is imported: test modules (and tools) import the model and the dispatch first and set
    TRITON_INTERPRET after, so neither may import Triton, nor may choosing an attention route (the kernels
    load on first use)."""
    code = ("import sys, torch, kernels, kernels.dispatch, kernels.attention.cudnn_attention, model, offload, trainer; "
            "kernels.attention.candidates(torch.device('cpu'), 128, 'triton'); "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("asked, runs", [(None, "0" if torch.cuda.is_available() else "1"), ("0", "0"), ("1", "1")])
def test_the_test_helper_interprets_without_a_gpu_unless_told(asked, runs):
    """conftest_kernels in a fresh process: one test module that switched the interpreter on in a GPU
    session would make every later kernel run interpreted, on CUDA tensors too."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update({"TRITON_INTERPRET": asked} if asked else {})
    script = "import os, tests.conftest_kernels; print(os.environ['TRITON_INTERPRET'])"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == runs
