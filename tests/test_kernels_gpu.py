"""Issue-3 kernels at real shapes in bf16 on a CUDA GPU, against the fp32 reference.

Skipped without CUDA, and under TRITON_INTERPRET=1 (tests/conftest.py sets it on a machine without a GPU,
and compiles on one with a GPU unless told).
"""
import conftest_kernels
import pytest
import torch

from kernels import reference

pytestmark = conftest_kernels.needs_compiled_gpu


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check_norm(op, reference_op, rows: int, hidden: int, with_bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    params = [(1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16).requires_grad_()]
    if with_bias:
        params.append((0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16).requires_grad_())
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    y = op(x, *params, 1e-5)
    y.backward(dy)
    ref_inputs = [t.detach().float().requires_grad_() for t in (x, *params)]
    y_ref = reference_op(*ref_inputs, 1e-5)
    y_ref.backward(dy.float())
    assert relative_error(y, y_ref) < 5e-3
    for ours, ref in zip((x, *params), ref_inputs):
        assert relative_error(ours.grad, ref.grad) < 5e-3


def test_rms_norm_bf16_real_shape():
    from kernels.rms_norm_triton import rms_norm
    check_norm(rms_norm, reference.rms_norm, 65536, 4096, with_bias=False)


def test_rms_norm_bf16_rows_of_one_head():
    """QK-norm's rows (Qwen3-8B's 32 query heads of 128 at 8k tokens, plus a tail that fills no tile)."""
    from kernels.rms_norm_triton import rms_norm
    check_norm(rms_norm, reference.rms_norm, 8192 * 32 + 5, 128, with_bias=False)


def test_layer_norm_bf16_real_shape():
    from kernels.layer_norm_triton import layer_norm
    check_norm(lambda x, w, b, eps: layer_norm(x, w, b, eps),
               lambda x, w, b, eps: reference.layer_norm(x, w, b, eps), 65536, 4096, with_bias=True)


@pytest.fixture(scope="module")
def llama_head():
    """N=16384 tokens of Llama-3's head (H=4096, V=128256) in bf16, with fp32 reference gradients."""
    torch.manual_seed(0)
    n_tokens, hidden_size, vocab = 16384, 4096, 128256
    hidden = torch.randn(n_tokens, hidden_size, device="cuda").to(torch.bfloat16)
    weight = (0.02 * torch.randn(vocab, hidden_size, device="cuda")).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n_tokens,), device="cuda")
    targets[torch.rand(n_tokens, device="cuda") < 0.1] = -100
    hidden_ref = hidden.float().requires_grad_()
    weight_ref = weight.float().requires_grad_()
    loss_ref = reference.linear_cross_entropy(hidden_ref, weight_ref, targets)
    loss_ref.backward()
    ref = (loss_ref.detach(), hidden_ref.grad, weight_ref.grad)
    del hidden_ref, weight_ref, loss_ref
    torch.cuda.empty_cache()
    return hidden, weight, targets, ref


@pytest.mark.parametrize("memory_budget", [None, 8 * 2**30], ids=["default-bf16-accumulation", "fp32-accumulation"])
def test_linear_cross_entropy_bf16_real_shape(llama_head, memory_budget):
    from kernels.linear_cross_entropy_triton import linear_cross_entropy, plan_chunks
    hidden, weight, targets, (loss_ref, grad_hidden_ref, grad_weight_ref) = llama_head
    chunk, accumulate_fp32 = plan_chunks(*hidden.shape, weight.shape[0], hidden.dtype, True,
                                         memory_budget or 7 * 2**28)
    print(f"chunk={chunk} accumulate_fp32={accumulate_fp32}")
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss = linear_cross_entropy(hidden, weight, targets, memory_budget=memory_budget)
    loss.backward()
    errors = [relative_error(loss, loss_ref), relative_error(hidden.grad, grad_hidden_ref),
              relative_error(weight.grad, grad_weight_ref)]
    print("relative errors loss, grad_hidden, grad_weight:", errors)
    assert errors[0] < 1e-3 and errors[1] < 1e-2 and errors[2] < 1e-2
