"""Op dispatch: reference on CPU, Triton on request, and a clear error when Triton cannot run."""
import pytest
import torch

import kernels


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    kernels.set_backend("auto")


def test_cpu_tensors_use_the_reference_under_auto():
    x = torch.randn(3, 8)
    kernels.set_backend("auto")
    assert kernels._pick("rms_norm", x) is kernels.reference.rms_norm


def test_triton_without_cuda_or_interpreter_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="kernels=triton needs a CUDA GPU"):
        kernels.set_backend("triton")


def test_triton_under_the_interpreter_dispatches_to_the_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.set_backend("triton")
    assert kernels._pick("attention", torch.randn(1)) is kernels._triton_op("attention")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="must be one of"):
        kernels.set_backend("cuda")


@pytest.mark.parametrize("name", sorted(kernels.TRITON_OPS))
def test_every_op_has_a_reference_and_a_triton_kernel(name):
    assert callable(getattr(kernels.reference, name))
    assert callable(kernels._triton_op(name))


@pytest.mark.parametrize("head_dim, expect_kernel", [(16, False), (64, True)])
def test_auto_falls_back_to_the_reference_for_head_dims_the_kernel_lacks(monkeypatch, head_dim, expect_kernel):
    """On a GPU "auto" picks the Triton attention; a head dim it does not handle (the tiny model's 16)
    must run the reference instead of raising."""
    calls = []

    def kernel(q, k, v, **options):
        calls.append(q.shape)
        return torch.zeros_like(q)
    monkeypatch.setattr(kernels, "_pick", lambda name, tensor: kernel)   # as if the tensors were on CUDA
    q, k, v = (torch.randn(1, 5, 2, head_dim) for _ in range(3))
    out = kernels.attention(q, k, v)
    assert bool(calls) == expect_kernel
    if not expect_kernel:
        torch.testing.assert_close(out, kernels.reference.attention(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("backend, device_type, head_dim, records", [
    ("reference", "cuda", 128, False), ("auto", "cpu", 128, False), ("auto", "cuda", 128, True),
    ("auto", "cuda", 16, False), ("triton", "cpu", 64, True)])
def test_only_the_triton_attention_records_on_a_tape(backend, device_type, head_dim, records):
    assert kernels.attention_records(backend, device_type, head_dim) == records
