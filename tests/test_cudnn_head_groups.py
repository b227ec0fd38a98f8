"""kernels.attention.cudnn_attention's backward over groups of KV heads, on any device: the cuDNN call is replaced by
the reference attention's gradients, so what is tested is the grouping (which query heads go with which KV
heads, the statistics' slices, the copies into the whole gradients) against one call over every head."""
import weakref

import pytest
import torch

from kernels import reference
from kernels.attention import attention_workspace, cudnn_attention, route

CUDNN = route.AttentionRoute("triton", "cudnn")    # cuDNN's own forward (the stand-in below) and backward


def _reference_backward(grad_out, q, k, v, out, lse, causal, scale):
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.is_contiguous()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():       # an autograd.Function's backward runs without it
        result = reference.attention(*leaves, causal=causal, softmax_scale=scale)
    return torch.autograd.grad(result, leaves, grad_out)


def _forward_stand_in(q, k, v, *args, scale):
    """(out, lse) [B, H, S, D] and [B, H, S] as cuDNN's forward returns them."""
    out = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=args[3],
                              softmax_scale=scale)
    return out.transpose(1, 2), torch.zeros(q.shape[0], q.shape[1], q.shape[2])


@pytest.mark.parametrize("batch, q_heads, kv_heads, cap_elements", [(1, 8, 4, 8 * 40 * 16 * 4),
                                                                     (2, 12, 4, 8 * 2 * 40 * 12 * 16 // 3),
                                                                     (1, 6, 6, 1)])
def test_grouped_backward_equals_one_call(monkeypatch, batch, q_heads, kv_heads, cap_elements):
    seqlen, head_dim = 40, 16
    monkeypatch.setattr(cudnn_attention, "_backward", _reference_backward)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", _forward_stand_in, raising=False)
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen, q_heads, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, kv_heads, head_dim, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(batch, seqlen, q_heads, head_dim)
    expected = torch.autograd.grad(reference.attention(q, k, v), (q, k, v), grad_out)

    monkeypatch.setattr(cudnn_attention, "MAX_WORKSPACE_BYTES", cap_elements)
    groups = cudnn_attention.backward_head_groups(batch * seqlen, q_heads, kv_heads, head_dim)
    assert 1 < groups <= kv_heads and kv_heads % groups == 0
    grads = torch.autograd.grad(cudnn_attention.cudnn_attention(q, k, v, CUDNN), (q, k, v), grad_out)
    for name, actual, wanted in zip(("dq", "dk", "dv"), grads, expected):
        assert actual.shape == wanted.shape and not torch.isnan(actual).any(), name
        assert float((actual - wanted).norm() / wanted.norm()) < 1e-6, name


def test_head_groups_keep_one_call_within_the_cap_and_divide_the_kv_heads():
    whole = cudnn_attention.WORKSPACE_BYTES_PER_QUERY_ELEMENT * 32 * 128
    assert cudnn_attention.backward_head_groups(131072, 32, 8, 128) == 1      # 4 GiB: one call, as measured
    assert cudnn_attention.backward_head_groups(262144, 32, 8, 128) == 2
    assert cudnn_attention.backward_head_groups(524288, 32, 8, 128) == 4
    assert cudnn_attention.backward_head_groups(4 * 2**20, 32, 8, 128) == 8   # past the cap: one per KV head
    assert cudnn_attention.backward_head_groups(3 * 2**20 // 2 + 1, 32, 8, 128) == 8   # 3 would not divide 8
    assert cudnn_attention.backward_workspace_bytes(131072, 32, 8, 128) == 131072 * whole
    assert cudnn_attention.backward_workspace_bytes(524288, 32, 8, 128) == (
        524288 * whole // 4 + 524288 * (32 + 16) // 4 * 128 * 2)


def test_a_groups_gradients_are_freed_before_the_next_group_runs(monkeypatch):
    """The planner counts one group's gradients beside the workspace: none of an earlier group's may be
    alive when the next cuDNN call starts."""
    returned = []

    def backward_checking_the_last_groups_are_gone(*args):
        assert all(ref() is None for ref in returned), "an earlier group's gradients are still alive"
        grads = _reference_backward(*args)
        returned.extend(weakref.ref(grad) for grad in grads)
        return grads

    monkeypatch.setattr(cudnn_attention, "_backward", backward_checking_the_last_groups_are_gone)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", _forward_stand_in, raising=False)
    monkeypatch.setattr(cudnn_attention, "MAX_WORKSPACE_BYTES", 1)
    q = torch.randn(1, 24, 8, 16, requires_grad=True)
    k, v = (torch.randn(1, 24, 4, 16, requires_grad=True) for _ in range(2))
    assert cudnn_attention.backward_head_groups(24, 8, 4, 16) == 4
    torch.autograd.grad(cudnn_attention.cudnn_attention(q, k, v, CUDNN), (q, k, v), torch.randn(1, 24, 8, 16))
    assert len(returned) == 3 * 4


@pytest.mark.parametrize("tokens", [1, 4096, 32768, 131072, 262144, 524288, 4 * 2**20])
def test_the_one_pass_backward_fits_the_cudnn_workspace_of_llama3(tokens):
    """The route runs our one-pass backward only under plans that count cuDNN's workspace and where its fp32 dQ
    accumulator (one call's, over head groups) fits that: always with 8 KV heads."""
    one_pass = attention_workspace.one_pass_workspace_bytes(tokens, 32, 8, 128)
    assert 0 < one_pass <= attention_workspace.ONE_PASS_MAX_BYTES or tokens == 4 * 2**20
    assert route.one_pass_fits_cudnn_plan(tokens, 32, 8, 128, 2)


def test_the_one_pass_backward_can_outgrow_the_cudnn_workspace_with_three_kv_heads():
    """3 KV heads: cuDNN's 6 GiB splits in 3 groups of 2, the one-pass 3 GiB stays one call: it does not fit."""
    assert attention_workspace.one_pass_workspace_bytes(524288, 12, 3, 128) == 3 * 2**30
    assert not route.one_pass_fits_cudnn_plan(524288, 12, 3, 128, 2)
