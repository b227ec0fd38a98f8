"""Chunked fused linear cross-entropy (kernels/linear_cross_entropy_triton.py) on CPU through Triton's interpreter,
against the fp32 reference: loss and both gradients, fp32 and fp16, chunking-invariance, ignore_index,
frozen weight or hidden, gradient scaling. (bf16 at Llama-3 shapes: tests/test_kernels_gpu.py.)"""
import conftest_kernels  # first: interpreter or compiler settled before any kernels.* Triton module loads
from conftest_kernels import poisoned_empty  # noqa: F401  (fixture)

import importlib

import pytest
import torch

import kernels
from kernels import reference
from kernels.linear_cross_entropy_triton import DEFAULT_MEMORY_BUDGET, linear_cross_entropy, plan_chunks

pytestmark = conftest_kernels.needs_interpreter

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite (unwritten or NaN) values"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def make_inputs(n_tokens, hidden_size, vocab, dtype, ignored_fraction=0.25, ignore_index=-100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tokens, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size ** 0.5 * 3).to(dtype)
    targets = torch.randint(0, vocab, (n_tokens,), generator=generator)
    targets[torch.rand(n_tokens, generator=generator) < ignored_fraction] = ignore_index
    return hidden, weight.requires_grad_(), targets


def reference_result(hidden, weight, targets, **kwargs):
    hidden_ref = hidden.detach().float().requires_grad_()
    weight_ref = weight.detach().float().requires_grad_()
    loss = reference.linear_cross_entropy(hidden_ref, weight_ref, targets, **kwargs)
    loss.backward()
    return loss.detach(), hidden_ref.grad, weight_ref.grad


def our_result(hidden, weight, targets, **kwargs):
    loss = linear_cross_entropy(hidden, weight, targets, **kwargs)
    loss.backward()
    result = loss.detach(), hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    return result


# (N, H, V): one token; odd sizes; a vocabulary over several kernel blocks with a tail (9000).
SHAPES = [(1, 16, 37), (37, 32, 203), (64, 24, 1000), (8, 16, 9000)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradients_match_reference(poisoned_empty, shape, dtype, reduction):
    hidden, weight, targets = make_inputs(*shape, dtype, ignored_fraction=0.0 if shape[0] == 1 else 0.25)
    ours = our_result(hidden, weight, targets, reduction=reduction)
    expected = reference_result(hidden, weight, targets, reduction=reduction)
    assert ours[0].dtype == torch.float32
    assert ours[1].dtype == ours[2].dtype == dtype
    for out, ref in zip(ours, expected):
        assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_result_does_not_depend_on_chunking(poisoned_empty, dtype):
    hidden, weight, targets = make_inputs(50, 16, 300, dtype)
    row_bytes = 300 * dtype.itemsize
    budgets = {"1 token": 1, "7 tokens": 7 * row_bytes, "one chunk": 2**30}
    assert [plan_chunks(50, 16, 300, dtype, False, b)[0] for b in budgets.values()] == [1, 7, 50]
    results = {name: our_result(hidden, weight, targets, memory_budget=b) for name, b in budgets.items()}
    for name, result in results.items():
        for out, ref in zip(result, results["one chunk"]):
            assert relative_error(out, ref) < (1e-6 if dtype == torch.float32 else 2e-3), name


def test_launch_tuning_arguments_keep_the_results():
    """block_v and num_warps (what scripts/bench_kernels.py sweeps) reach the rows kernel: a block of 64
    columns walks the 300-word vocabulary in five steps, with the same values as one block."""
    hidden, weight, targets = make_inputs(20, 16, 300, torch.float32)
    ours = our_result(hidden, weight, targets, block_v=64, num_warps=2)
    for out, ref in zip(ours, our_result(hidden, weight, targets)):
        assert relative_error(out, ref) < 1e-6
    for out, ref in zip(ours, reference_result(hidden, weight, targets)):
        assert relative_error(out, ref) < 1e-5


def test_fp16_grad_weight_accumulates_in_fp32_when_it_fits():
    hidden, weight, targets = make_inputs(40, 16, 300, torch.float16)
    expected = reference_result(hidden, weight, targets)
    accumulator_bytes = 300 * 16 * 4
    for budget, fp32 in ((2 * accumulator_bytes + 5 * 600, True), (accumulator_bytes, False)):
        assert plan_chunks(40, 16, 300, torch.float16, True, budget)[1] is fp32
        ours = our_result(hidden, weight, targets, memory_budget=budget)
        assert ours[2].dtype == torch.float16
        assert relative_error(ours[2], expected[2]) < TOLERANCE[torch.float16]


def test_llama3_plan_fits_the_two_gib_budget():
    chunk, accumulate_fp32 = plan_chunks(131072, 4096, 128256, torch.bfloat16, True,
                                         DEFAULT_MEMORY_BUDGET)
    assert not accumulate_fp32 and chunk % 256 == 0
    assert chunk * 128256 * 2 <= DEFAULT_MEMORY_BUDGET < 2 * 2**30
    assert plan_chunks(131072, 4096, 128256, torch.bfloat16, True, 8 * 2**30)[1]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_targets_ignored_gives_zero_loss_and_gradients(poisoned_empty, reduction):
    hidden, weight, targets = make_inputs(12, 16, 50, torch.float32, ignored_fraction=1.0, ignore_index=-1)
    loss, grad_hidden, grad_weight = our_result(hidden, weight, targets, ignore_index=-1, reduction=reduction,
                                                memory_budget=5 * 50 * 4)
    assert loss.item() == 0.0
    assert torch.equal(grad_hidden, torch.zeros_like(grad_hidden))
    assert torch.equal(grad_weight, torch.zeros_like(grad_weight))


def test_custom_ignore_index():
    hidden, weight, targets = make_inputs(30, 16, 77, torch.float32, ignore_index=5)
    ours = our_result(hidden, weight, targets, ignore_index=5)
    expected = reference_result(hidden, weight, targets, ignore_index=5)
    for out, ref in zip(ours, expected):
        assert relative_error(out, ref) < 1e-5


def test_frozen_weight_does_no_grad_weight_work(monkeypatch):
    def fail(*args):
        raise AssertionError("grad_weight work for a frozen weight")

    # The module itself: the package attribute of its name is the dispatching function.
    monkeypatch.setattr(importlib.import_module("kernels.linear_cross_entropy_triton"), "_accumulate_grad_weight", fail)
    hidden, weight, targets = make_inputs(20, 16, 90, torch.float32)
    weight.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, targets, memory_budget=6 * 90 * 4)
    loss.backward()
    expected = reference_result(hidden, weight, targets)
    assert weight.grad is None
    assert relative_error(loss, expected[0]) < 1e-5 and relative_error(hidden.grad, expected[1]) < 1e-5


def test_hidden_without_grad_gets_none_and_weight_grad_is_right():
    hidden, weight, targets = make_inputs(20, 16, 90, torch.float32)
    hidden.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    assert hidden.grad is None
    assert relative_error(weight.grad, reference_result(hidden, weight, targets)[2]) < 1e-5


def test_no_grad_mode_returns_the_loss():
    hidden, weight, targets = make_inputs(20, 16, 90, torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets)
    assert not loss.requires_grad
    assert relative_error(loss, reference_result(hidden, weight, targets)[0]) < 1e-5


def test_backward_scales_by_the_incoming_gradient_once():
    hidden, weight, targets = make_inputs(20, 16, 90, torch.float32)
    expected = reference_result(hidden, weight, targets)
    loss = linear_cross_entropy(hidden, weight, targets)
    (2.5 * loss).backward(retain_graph=True)
    assert relative_error(hidden.grad, 2.5 * expected[1]) < 1e-5
    assert relative_error(weight.grad, 2.5 * expected[2]) < 1e-5
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_dispatch_runs_triton_when_asked():
    hidden, weight, targets = make_inputs(9, 16, 40, torch.float32)
    kernels.set_backend("triton")
    try:
        loss = kernels.linear_cross_entropy(hidden, weight, targets)
    finally:
        kernels.set_backend("auto")
    assert relative_error(loss, reference_result(hidden, weight, targets)[0]) < 1e-5


def test_clear_errors():
    hidden, weight, targets = make_inputs(4, 8, 10, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, targets, reduction="none")
    with pytest.raises(ValueError, match=r"hidden \[N, H\] and weight \[V, H\]"):
        linear_cross_entropy(hidden, weight[:, :7], targets)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(hidden, weight, targets[:3])
    with pytest.raises(TypeError, match="share one float dtype"):
        linear_cross_entropy(hidden, weight.double(), targets)


def test_autocast_runs_the_matmuls_in_its_dtype_and_returns_input_dtype_gradients():
    """fp32 weights under bf16 autocast (full fine-tuning of a small model on a GPU): computed like
    nn.Linear would, in bf16, with fp32 gradients for the fp32 inputs (it raised on the `out=` buffers)."""
    hidden, weight, targets = make_inputs(37, 32, 203, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = our_result(hidden, weight, targets)
    rounded = [t.detach().to(torch.bfloat16).float() for t in (hidden, weight)]
    expected = reference_result(*rounded, targets)
    assert ours[1].dtype == ours[2].dtype == torch.float32
    for out, ref in zip(ours, expected):
        assert relative_error(out, ref) < 1e-2


def test_a_tied_head_s_gradient_reaches_the_one_shared_embedding(poisoned_empty):  # noqa: F811
    """Llama 3.2 ties lm_head to the embedding: the chunked kernel reads that one parameter as the head, and its
    weight gradient adds to the embedding's lookup gradient on it, as the fp32 reference's does."""
    from model import CausalLM, DecoderConfig
    config = DecoderConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = CausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)
    expected = reference.linear_cross_entropy(model(ids).reshape(-1, 32), model.lm_head.weight, labels.reshape(-1))
    expected.backward()
    expected_grad, model.model.embed_tokens.weight.grad = model.model.embed_tokens.weight.grad, None
    loss = linear_cross_entropy(model(ids).reshape(-1, 32), model.lm_head.weight, labels.reshape(-1))
    loss.backward()
    grad = model.model.embed_tokens.weight.grad
    assert relative_error(loss, expected) < 1e-5 and relative_error(grad, expected_grad) < 1e-5
    head_only = torch.zeros_like(grad)
    head_only[ids.unique()] = 1
    assert (grad * (1 - head_only)).abs().max() > 0      # rows never looked up get the head's gradient too
