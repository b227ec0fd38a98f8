"""kernels.attention.cudnn_attention on a Hopper GPU: the reference's contract in bf16, the attention tape, the
route that sends unpacked rows to it, and the backward workspace the planner counts. Skipped elsewhere."""
import os

import pytest
import torch

import kernels
from conf.capability import gpu_capability
from kernels import reference
from kernels.attention import (attention, attention_tape, choose_route, cudnn_attention, flash_attention,
                               flash_attention_hopper)
from kernels.attention.attention_tape import AttentionTape
from kernels.attention.route import AttentionRoute
from kernels.attention.route import flash_attention as ours

CUDNN = AttentionRoute("gluon", "cudnn")      # cuDNN's backward after the Gluon forward where it reads the inputs

pytestmark = pytest.mark.skipif(not gpu_capability(torch.device("cuda")).cudnn_attention_backward,
                                reason="needs a Hopper GPU with cuDNN")
# Observed on the H100: 2.1e-3 for the output, 2.9e-3 to 3.4e-3 for the gradients (bf16 inputs).
TOLERANCE = 5e-3


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    kernels.set_backend("auto")


def cudnn(q, k, v):
    return attention(q, k, v, CUDNN)


def _rel_err(actual, expected):
    assert not torch.isnan(actual).any()
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm())


def _inputs(seqlen, q_heads=32, kv_heads=8, head_dim=128, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(1, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for heads in (q_heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("seqlen, q_heads, kv_heads, head_dim, causal", [
    (4096, 32, 8, 128, True), (1000, 8, 2, 64, True), (777, 4, 4, 128, False),
    (2048, 28, 4, 128, True), (1500, 24, 8, 128, True)])   # groups of seven (Qwen2.5-7B) and three (Llama-3.2-3B)
def test_matches_the_fp32_reference(seqlen, q_heads, kv_heads, head_dim, causal):
    q, k, v = _inputs(seqlen, q_heads, kv_heads, head_dim)
    out = attention(q, k, v, CUDNN, causal=causal)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q32, k32, v32, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
    for name, actual, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert actual.shape == expected.shape and actual.dtype == torch.bfloat16, name
        assert _rel_err(actual, expected) < TOLERANCE, (name, _rel_err(actual, expected))


def test_the_forward_is_the_gluon_kernel_and_its_statistics_are_cudnns():
    """On Hopper the forward is kernels.attention.flash_attention_hopper's (the gradients above use its statistics); its
    log-sum-exp, turned to natural log, equals the statistics cuDNN's own forward returns."""
    q, k, v = (t.detach() for t in _inputs(2048, 8, 2))
    if not flash_attention_hopper.supports(q):
        pytest.skip("the Gluon forward runs on Hopper only, not under TRITON_OVERRIDE_ARCH=sm80")
    out = cudnn(q, k, v)
    flash_attention.ensure_allocator(q.device)
    expected, _ = flash_attention_hopper.attention_forward(q, k, v, None, None, True,
                                                           128 ** -0.5 * flash_attention.LOG2E)
    assert torch.equal(out, expected)
    heads_first = [t.transpose(1, 2) for t in (q, k, v)]
    cudnn_stats = torch.ops.aten._scaled_dot_product_cudnn_attention(*heads_first, None, True, 0.0, True, False)[1]
    _, stats = cudnn_attention._forward(q, k, v, True, 128 ** -0.5, "gluon")
    assert stats.shape == cudnn_stats.shape
    assert torch.allclose(stats, cudnn_stats, rtol=0, atol=1e-4)


def test_a_replayed_tape_gives_the_recorded_output_and_the_same_gradients():
    q, k, v = _inputs(2048)
    grad_out = torch.randn(1, 2048, 32, 128, device="cuda", dtype=torch.bfloat16)
    tape = AttentionTape()
    with tape.recording():
        recorded = cudnn(q, k, v)
    assert len(tape.saved) == 1 and tape.saved[0][0] is recorded
    expected = torch.autograd.grad(recorded, (q, k, v), grad_out)
    with tape.replaying():
        replayed = cudnn(q, k, v)
    assert torch.equal(replayed, recorded)
    dq, dk, dv = torch.autograd.grad(replayed, (q, k, v), grad_out)
    assert torch.equal(dk, expected[1]) and torch.equal(dv, expected[2])   # dQ is added with atomics
    assert _rel_err(dq, expected[0]) < 1e-2
    assert attention_tape._state.current is None


def test_the_route_sends_unpacked_rows_to_cudnn_and_packed_documents_to_our_kernels():
    q, k, v = _inputs(1024)
    route = choose_route(q.device, 128, "auto")       # a plan with room for cuDNN's workspace
    assert route.backward == "cudnn"
    assert torch.equal(attention(q, k, v, route), cudnn(q, k, v))
    cu_seqlens = torch.tensor([0, 300, 1024], dtype=torch.int32, device="cuda")
    packed = attention(q, k, v, route, cu_seqlens=cu_seqlens)
    assert torch.equal(packed, ours(q, k, v, cu_seqlens=cu_seqlens))
    kernels.set_backend("auto")
    assert torch.equal(kernels.attention.attention(q, k, v), ours(q, k, v))     # no route installed: ours


def test_strided_views_of_one_projection_and_a_broadcast_gradient():
    """q, k, v as views of one fused projection output, and dO broadcast from out.sum() (stride 0)."""
    torch.manual_seed(3)
    fused = torch.randn(1, 512, 48, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = fused[:, :, :32], fused[:, :, 32:40], fused[:, :, 40:]
    out = cudnn(q, k, v)
    ref = reference.attention(q.float(), k.float(), v.float())
    assert _rel_err(out, ref) < TOLERANCE
    out.sum().backward()
    q32 = fused.detach().float().requires_grad_()
    reference.attention(q32[:, :, :32], q32[:, :, 32:40], q32[:, :, 40:]).sum().backward()
    assert _rel_err(fused.grad, q32.grad) < TOLERANCE


@pytest.mark.parametrize("groups", [1, 4])
def test_backward_stays_within_the_planned_workspace(monkeypatch, groups):
    """The backward's peak beyond its inputs and dq/dk/dv is at most what the planner counts for it, in one
    call and over 4 head groups (a workspace cap of a quarter of one call's: one group's gradients count)."""
    seqlen = 16384
    whole = cudnn_attention.WORKSPACE_BYTES_PER_QUERY_ELEMENT * seqlen * 32 * 128
    monkeypatch.setattr(cudnn_attention, "MAX_WORKSPACE_BYTES", whole // groups)
    assert cudnn_attention.backward_head_groups(seqlen, 32, 8, 128) == groups
    q, k, v = _inputs(seqlen)
    out = cudnn(q, k, v)
    grad_out = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - sum(g.numel() * g.element_size() for g in grads)
    planned = cudnn_attention.backward_workspace_bytes(seqlen, 32, 8, 128)
    assert 0.5 * planned < extra <= planned * 1.05, (extra, planned)


def test_the_backward_over_head_groups_matches_the_reference(monkeypatch):
    """A workspace cap of a quarter of this call's splits the backward over 4 groups of 2 KV heads."""
    q, k, v = _inputs(4096)
    monkeypatch.setattr(cudnn_attention, "MAX_WORKSPACE_BYTES", cudnn_attention.backward_workspace_bytes(
        4096, 32, 8, 128) // 4)
    assert cudnn_attention.backward_head_groups(4096, 32, 8, 128) == 4
    out = cudnn(q, k, v)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(reference.attention(q32, k32, v32), (q32, k32, v32), grad_out.float())
    for name, actual, expected in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _rel_err(actual, expected) < TOLERANCE, (name, _rel_err(actual, expected))


@pytest.mark.skipif(not os.environ.get("LONGCTX_LONG_GPU_TESTS"), reason="a minute at 524k: LONGCTX_LONG_GPU_TESTS=1")
def test_524k_tokens_over_head_groups_agree_with_flash_attention(monkeypatch):
    """The longest single-GPU length (2^31 elements in q): kernels=auto's attention (the Gluon forward where it
    runs, cuDNN's backward over 4 head groups) against our Triton flash attention's forward and backward,
    both bf16 (each within ~3e-3 of fp32 at shorter lengths)."""
    q, k, v = _inputs(524288)
    assert cudnn_attention.backward_head_groups(524288, 32, 8, 128) == 4
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def run(attention):
        out = attention(q, k, v)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out))
    auto = run(cudnn)
    monkeypatch.setattr(flash_attention_hopper, "supports", lambda q: False)   # the Triton forward
    flash = run(ours)
    for name, a, b in zip(("out", "dq", "dk", "dv"), auto, flash):
        error = _rel_err_by_head(a, b)
        assert error < 1e-2, (name, error)


def _rel_err_by_head(actual, expected):
    """_rel_err one head at a time: fp64 copies of a whole 524k tensor would take 16 GiB each."""
    difference = reference_norm = 0.0
    for head in range(actual.shape[2]):
        a, e = actual[:, :, head].detach().double(), expected[:, :, head].detach().double()
        assert not torch.isnan(a).any()
        difference += float((a - e).square().sum())
        reference_norm += float(e.square().sum())
    return (difference / reference_norm) ** 0.5
