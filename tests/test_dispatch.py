"""Op dispatch: reference on CPU, Triton on request, and a clear error when Triton cannot run."""
import importlib
import os
import subprocess
import sys

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


def test_triton_under_the_interpreter_dispatches_to_the_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.set_backend("triton")
    assert dispatch._pick("attention", torch.randn(1)) is dispatch._triton_op("attention")


@pytest.mark.parametrize("deterministic,attention_kernel,two_kernel_backward", [
    (True, "cudnn", True), (False, "cudnn", False), (False, "flash", True), (True, "flash", True)])
def test_attention_is_told_which_backward_to_run(monkeypatch, deterministic, attention_kernel, two_kernel_backward):
    """flash_attention runs its one-pass backward (atomics, a workspace) only where the job is not deterministic
    and its plan counted cuDNN's backward workspace, which is larger: packed rows of a "cudnn" plan."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []
    monkeypatch.setattr(dispatch, "_triton_op", lambda name: lambda *args, **options: seen.append(options))
    kernels.set_backend("triton", attention_kernel, deterministic)
    q = torch.randn(1, 4, 2, 16)
    dispatch.attention(q, q, q, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))   # cuDNN takes no packed rows
    assert [options["deterministic"] for options in seen] == [two_kernel_backward]


def test_unknown_backend_is_rejected():
    with pytest.raises(ConfigError, match="is not one of"):
        kernels.set_backend("cuda")


@pytest.mark.parametrize("name", sorted(dispatch.TRITON_OPS))
def test_every_op_has_a_reference_and_a_triton_kernel(name):
    assert callable(getattr(kernels.reference, name))
    assert callable(dispatch._triton_op(name))


def test_the_package_attributes_stay_the_dispatching_functions_after_the_kernel_modules_load():
    """Each Triton module is named after its op; loading it must not replace the package's function."""
    import kernels.layer_norm  # noqa: F401  (the import statement binds submodules on the package)
    import kernels.rms_norm  # noqa: F401
    for module_name, _ in dispatch.TRITON_OPS.values():
        importlib.import_module(module_name)
    for name in dispatch.TRITON_OPS:
        assert getattr(kernels, name) is getattr(dispatch, name)
    assert importlib.import_module("kernels.rms_norm").rms_norm is not kernels.rms_norm


@pytest.mark.parametrize("head_dim, dtype, expect_kernel", [
    (16, torch.float32, False), (64, torch.float32, True), (64, torch.float64, False)])
def test_auto_falls_back_to_the_reference_for_shapes_the_kernel_lacks(monkeypatch, head_dim, dtype, expect_kernel):
    """On a GPU "auto" picks the Triton attention; a head dim or dtype it does not handle (the tiny
    model's head dim 16) must run the reference instead of raising."""
    calls = []

    def kernel(q, k, v, **options):
        calls.append(q.shape)
        return torch.zeros_like(q)
    runs = dispatch._triton_attention_runs
    monkeypatch.setattr(dispatch, "_triton_op", lambda name: kernel)
    monkeypatch.setattr(dispatch, "_triton_attention_runs",   # as if the tensors were on CUDA
                        lambda backend, device_type, head_dim, dtype: runs(backend, "cuda", head_dim, dtype))
    q, k, v = (torch.randn(1, 5, 2, head_dim, dtype=dtype) for _ in range(3))
    out = kernels.attention(q, k, v)
    assert bool(calls) == expect_kernel
    if not expect_kernel:
        torch.testing.assert_close(out, kernels.reference.attention(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("backend, device_type, head_dim, records", [
    ("reference", "cuda", 128, False), ("auto", "cpu", 128, False), ("auto", "cuda", 128, True),
    ("auto", "cuda", 16, False), ("triton", "cpu", 64, True), ("triton", "cuda", 16, False)])
def test_only_the_triton_attention_records_on_a_tape(backend, device_type, head_dim, records):
    assert kernels.attention_records(backend, device_type, head_dim) == records


@pytest.mark.parametrize("backend, deterministic, hopper, expected", [
    ("auto", False, True, ("cudnn", "flash")),
    ("auto", True, True, ("flash",)),          # cuDNN's backward adds dQ with atomics
    ("triton", False, True, ("flash",)),       # our Triton kernels throughout
    ("auto", False, False, ("flash",)),        # an A100: ours
])
def test_attention_kernels_offered_to_the_planner(backend, deterministic, hopper, expected):
    assert kernels.attention_kernels(backend, deterministic, torch.device("cuda"), hopper) == expected
    assert kernels.attention_kernels(backend, deterministic, torch.device("cpu"), hopper) == ("flash",)


def test_a_cudnn_plan_still_runs_the_reference_on_cpu_tensors_and_rejects_unknown_kernels():
    kernels.set_backend("auto", "cudnn")
    q, k, v = (torch.randn(1, 6, 2, 16) for _ in range(3))
    torch.testing.assert_close(kernels.attention(q, k, v), kernels.reference.attention(q, k, v))
    with pytest.raises(ValueError, match="attention_kernel='sdpa' is not one of"):
        kernels.set_backend("auto", "sdpa")


def test_importing_the_model_and_the_dispatch_leaves_triton_unimported():
    """Triton chooses interpreter or compiler when it is first imported, and a kernel module's `triton.jit`
    when it is imported: test modules (and tools) import the model and the dispatch first and set
    TRITON_INTERPRET after, so neither may import Triton (the cuDNN path imports the Gluon forward lazily)."""
    code = ("import sys, kernels, kernels.dispatch, kernels.cudnn_attention, model, offload, trainer; "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("kv_heads, v_dtype, message", [(3, torch.bfloat16, "multiple of key/value heads"),
                                                       (2, torch.float16, "share one dtype")])
def test_the_cudnn_path_checks_shapes_before_any_kernel(monkeypatch, kv_heads, v_dtype, message):
    """Where its forward is the Gluon kernel (Hopper; said so here on any device), which reads K/V heads as
    q_heads // kv_heads, inputs it cannot take are refused with the flash attention's message before it runs."""
    from kernels import cudnn_attention, flash_attention_hopper
    monkeypatch.setattr(flash_attention_hopper, "supports", lambda q: True)
    q = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, kv_heads, 64, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match=message):
        cudnn_attention._forward(q, k, k.to(v_dtype), True, 0.125)


@pytest.mark.parametrize("asked, runs", [(None, "0" if torch.cuda.is_available() else "1"), ("0", "0"), ("1", "1")])
def test_the_test_helper_interprets_without_a_gpu_unless_told(asked, runs):
    """conftest_kernels in a fresh process: one test module that switched the interpreter on in a GPU
    session would make every later kernel run interpreted, on CUDA tensors too."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update({"TRITON_INTERPRET": asked} if asked else {})
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = (f"import sys; sys.path.insert(0, {tests_dir!r}); import conftest_kernels, os; "
              "print(os.environ['TRITON_INTERPRET'])")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == runs
