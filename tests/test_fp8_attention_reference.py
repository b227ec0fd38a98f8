"""The FP8 attention contract (kernels.reference.fp8_attention, issue 48) against hand-built oracles on the CPU:
block scales, the fixed scale of P, the rotation, documents, GQA, causality, non-finite inputs, and its error
against fp32 beside bf16's, with and without outlier channels."""
import math

import pytest
import torch

from kernels import reference

D = 16


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def dense_attention(q, k, v, causal, cu_seqlens=None, quantize_p=False):
    """fp64 attention with a dense mask: out and lse (base 2); with quantize_p, P = exp(S - rowmax) is rounded to
    e4m3 at the fixed scale before the product (the sum stays P's own)."""
    batch, seqlen, q_heads, head_dim = q.shape
    q, k, v = (t.double().reshape(1, batch * seqlen, t.shape[2], head_dim) for t in (q, k, v))
    k, v = (t.repeat_interleave(q_heads // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * head_dim ** -0.5
    tokens = torch.arange(batch * seqlen)
    visible = torch.ones(batch * seqlen, batch * seqlen, dtype=torch.bool)
    if causal:
        visible &= tokens[None, :] <= tokens[:, None]
    if cu_seqlens is not None:
        doc = reference.document_ids(cu_seqlens, batch * seqlen)
        visible &= doc[:, None] == doc[None, :]
    else:
        visible &= (tokens[:, None] // seqlen) == (tokens[None, :] // seqlen)
    scores = scores.masked_fill(~visible, -math.inf)
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = p
    if quantize_p:
        weights = (p * 256).to(torch.float8_e4m3fn).double() / 256
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v) / p.sum(dim=-1).transpose(1, 2)[..., None]
    lse = torch.logsumexp(scores, dim=-1) / math.log(2)
    return out.reshape(batch, seqlen, q_heads, head_dim), lse.reshape(q_heads, batch, seqlen).transpose(0, 1)


def relative_error(value, exact):
    return float((value.double() - exact.double()).norm() / exact.double().norm())


def e4m3_blocks(tokens, heads, block, exponents, seed):
    """[1, tokens, heads, D] fp32 values that block quantization keeps exactly: e4m3 values whose block amax is
    448 (one element per block set to ±448), times 2^exponent, the exponent cycling over the blocks."""
    values = (randn(1, tokens, heads, D, seed=seed) * 60).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    for index, first in enumerate(range(0, tokens, block)):
        values[:, first, :, 0] = 448.0 * (-1) ** index
        values[:, first:first + block] *= 2.0 ** exponents[index % len(exponents)]
    return values


def test_block_scales_are_quantize_rows_per_token_block():
    x = randn(2, 100, 3, D)
    x[1, 32:64, 2] = 0.0
    values, scale = reference.quantize_token_blocks(x, 32)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape and scale.shape == (2, 3, 4)
    for b in range(2):
        for h in range(3):
            for block, first in enumerate(range(0, 100, 32)):
                rows = x[b, first:first + 32, h].reshape(1, -1)
                expected_values, expected_scale = reference.quantize_rows(rows)
                assert scale[b, h, block] == expected_scale[0]
                assert torch.equal(values[b, first:first + 32, h].reshape(1, -1).float(), expected_values.float())
    # An all-zero block dequantizes to zeros with the smallest scale; the other blocks keep theirs.
    assert scale[1, 2, 1] == reference.FP8_MIN_AMAX / reference.FP8_MAX
    assert torch.count_nonzero(values[1, 32:64, 2].float()) == 0


def test_one_block_much_larger_leaves_the_others_as_they_were():
    x = randn(1, 128, 2, D)
    louder = x.clone()
    louder[:, 32:64, 1] *= 1000
    (values, scale), (loud_values, loud_scale) = (reference.quantize_token_blocks(t, 32) for t in (x, louder))
    others = torch.ones(128, dtype=torch.bool)
    others[32:64] = False
    assert torch.equal(values[:, others].float(), loud_values[:, others].float())
    assert torch.equal(values[:, :, 0].float(), loud_values[:, :, 0].float())
    assert float(loud_scale[0, 1, 1]) == pytest.approx(1000 * float(scale[0, 1, 1]), rel=1e-6)
    # Through the attention: a query block 1000 times larger changes no other query block's rows.
    k, v = randn(1, 128, 1, D, seed=1), randn(1, 128, 1, D, seed=2)
    q = randn(1, 128, 2, D, seed=3) * 0.3
    loud_q = q.clone()
    loud_q[:, 32:64, 1] *= 1000
    out, loud_out = (reference.fp8_attention(t, k, v, block_m=32, block_n=32) for t in (q, loud_q))
    assert torch.equal(out[:, others], loud_out[:, others]) and torch.equal(out[:, :, 0], loud_out[:, :, 0])
    assert not torch.equal(out[:, 32:64, 1], loud_out[:, 32:64, 1])


@pytest.mark.parametrize("causal, q_exponent", [(True, -8), (False, -8), (True, -4)])
def test_exactly_representable_inputs_give_the_hand_simulated_result(causal, q_exponent):
    # Block scales 2^16 apart alternate: a scale over more than one block (or the wrong blocks) leaves the small
    # blocks' values in e4m3's subnormals or below them, and they would no longer be exact. With q 16 times
    # larger the logits spread over about 20, and P's small values test its fixed scale.
    q = e4m3_blocks(96, 4, 32, (q_exponent, q_exponent - 16), seed=0)
    k = e4m3_blocks(96, 2, 16, (-7, -23), seed=1)
    v = e4m3_blocks(96, 2, 16, (0, -16), seed=2)
    for x, block in ((q, 32), (k, 16), (v, 16)):
        values, scale = reference.quantize_token_blocks(x, block)
        assert torch.equal(values.float() * scale.repeat_interleave(block, dim=2).transpose(1, 2)[..., None], x)
    out, lse = reference.fp8_attention(q, k, v, causal, block_m=32, block_n=16, return_lse=True)
    expected, expected_lse = dense_attention(q, k, v, causal, quantize_p=True)
    assert out.dtype == torch.float32 and lse.shape == (1, 4, 96)
    assert relative_error(out, expected) < 1e-6
    assert torch.allclose(lse.double(), expected_lse, rtol=1e-6, atol=1e-6)
    # P's rounding is part of the contract: without it the result is measurably different.
    assert relative_error(out, dense_attention(q, k, v, causal)[0]) > 1e-3


def test_straight_through_gradient_of_v_is_the_quantized_probabilities():
    q, k, v = (e4m3_blocks(64, h, 32, (-8,), seed=s) for h, s in ((2, 0), (1, 1), (1, 2)))
    v.requires_grad_()
    dout = randn(1, 64, 2, D, seed=3)
    out = reference.fp8_attention(q, k, v, block_m=32, block_n=32)
    out.backward(dout)
    with torch.no_grad():     # the blocks are checkpointed only under autograd: the same values either way
        assert torch.equal(reference.fp8_attention(q, k, v, block_m=32, block_n=32), out)
    seqlen = 64
    scores = torch.einsum("bqhd,bkd->bhqk", q.double(), k[:, :, 0].double()) * D ** -0.5
    scores = scores.masked_fill(~torch.ones(seqlen, seqlen, dtype=torch.bool).tril(), -math.inf)
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = (p * 256).to(torch.float8_e4m3fn).double() / 256 / p.sum(dim=-1, keepdim=True)
    expected = torch.einsum("bhqk,bqhd->bkd", weights, dout.double())
    assert relative_error(v.grad[:, :, 0], expected) < 1e-6


def test_rotation_is_orthogonal_seeded_and_leaves_exact_attention_unchanged():
    rotation = reference.hadamard_rotation(64, seed=5).double()
    assert torch.allclose(rotation @ rotation.t(), torch.eye(64, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(rotation.abs(), torch.full_like(rotation, 64 ** -0.5))
    assert torch.equal(reference.hadamard_rotation(64, seed=5), reference.hadamard_rotation(64, seed=5))
    assert not torch.equal(reference.hadamard_rotation(64, seed=5), reference.hadamard_rotation(64, seed=6))
    with pytest.raises(ValueError, match="power of two, got 48"):
        reference.hadamard_rotation(48, seed=0)
    exact = reference.hadamard_rotation(D, seed=1).double()     # entries ±1/4: exact in fp32
    q, k, v = (randn(1, 40, h, D, seed=s, dtype=torch.float64) for h, s in ((2, 0), (1, 1), (1, 2)))
    rotated, _ = dense_attention(q @ exact, k @ exact, v, True)
    assert torch.allclose(rotated, dense_attention(q, k, v, True)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_with_gqa_match_each_document_alone(causal):
    # Documents start on block boundaries (the blocks run over the flattened axis); one crosses the batch rows.
    q, k, v = randn(2, 96, 4, D), randn(2, 96, 2, D, seed=1), randn(2, 96, 2, D, seed=2)
    cu_seqlens = torch.tensor([0, 64, 160, 192], dtype=torch.int32)
    out, lse = reference.fp8_attention(q, k, v, causal, cu_seqlens, block_m=32, block_n=16, return_lse=True)
    assert lse.shape == (2, 4, 96)
    flat = [t.reshape(1, 192, *t.shape[2:]) for t in (q, k, v, out)]
    flat_lse = lse.transpose(0, 1).reshape(4, 192)
    bounds = cu_seqlens.tolist()
    for first, end in zip(bounds, bounds[1:]):
        alone, alone_lse = reference.fp8_attention(*(t[:, first:end] for t in flat[:3]), causal, block_m=32,
                                                   block_n=16, return_lse=True)
        assert torch.allclose(flat[3][:, first:end], alone, rtol=0, atol=1e-6)
        assert torch.allclose(flat_lse[:, first:end], alone_lse[0], rtol=0, atol=1e-5)
    # And the documents are masked from each other: the dense oracle without P's rounding is close.
    assert relative_error(out, dense_attention(q, k, v, causal, cu_seqlens)[0]) < 0.1


def test_causal_rows_ignore_later_blocks():
    q, k, v = randn(1, 128, 2, D), randn(1, 128, 2, D, seed=1), randn(1, 128, 2, D, seed=2)
    changed = [t.clone() for t in (q, k, v)]
    for t in changed:
        t[:, 64:] = randn(1, 64, t.shape[2], D, seed=9) * 5
    for causal in (True, False):
        out, out_changed = (reference.fp8_attention(*inputs, causal, block_m=32, block_n=32)
                            for inputs in ((q, k, v), changed))
        assert torch.equal(out[:, :64], out_changed[:, :64]) == causal


def test_non_finite_values_reach_exactly_the_rows_that_see_their_block():
    q, k, v = randn(1, 128, 4, D), randn(1, 128, 2, D, seed=1), randn(1, 128, 2, D, seed=2)
    bad_q = q.clone()
    bad_q[0, 40, 1, 3] = math.nan
    out = reference.fp8_attention(bad_q, k, v, block_m=32, block_n=32)
    expected = torch.zeros(128, 4, dtype=torch.bool)
    expected[32:64, 1] = True
    assert torch.equal(out.isnan().any(dim=-1)[0], expected) and not out.isnan()[0, ~expected].any()
    # A key or value block with a non-finite value: the rows of the query heads that read its KV head and see
    # a key of its block (from the block's first token on, causal).
    for name in ("k", "v"):
        inputs = {"k": k.clone(), "v": v.clone()}
        inputs[name][0, 70, 0, 5] = math.inf
        out = reference.fp8_attention(q, inputs["k"], inputs["v"], block_m=32, block_n=32)
        expected = torch.zeros(128, 4, dtype=torch.bool)
        expected[64:, :2] = True
        assert torch.equal(out.isnan().any(dim=-1)[0], expected), name
        assert torch.equal(out.isnan().all(dim=-1)[0], expected), name
    # Not causal, packed: the other document's rows never see the block.
    bad_k = k.clone()
    bad_k[0, 100, 1, 0] = -math.inf
    cu_seqlens = torch.tensor([0, 64, 128], dtype=torch.int32)
    out = reference.fp8_attention(q, bad_k, v, False, cu_seqlens, block_m=32, block_n=32)
    expected = torch.zeros(128, 4, dtype=torch.bool)
    expected[64:, 2:] = True
    assert torch.equal(out.isnan().any(dim=-1)[0], expected)


def test_backward_from_kept_statistics_is_attentions_backward():
    q, k, v = randn(2, 48, 4, D, dtype=torch.float64), randn(2, 48, 2, D, seed=1, dtype=torch.float64), \
        randn(2, 48, 2, D, seed=2, dtype=torch.float64)
    dout = randn(2, 48, 4, D, seed=3, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 20, 70, 96], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = reference.attention(*leaves, True, cu_seqlens)
    out.backward(dout)
    _, lse = dense_attention(q, k, v, True, cu_seqlens)
    grads = reference.attention_backward(q, k, v, out.detach(), lse, dout, True, cu_seqlens, block_m=16)
    for grad, leaf in zip(grads, leaves):
        assert grad.dtype == torch.float64 and relative_error(grad, leaf.grad) < 1e-5


def outlier_inputs(seed):
    """q, k with 4 of 64 channels 8 times larger (the same in both), as real activations have; q scaled down so
    the logits spread as for random inputs."""
    q, k, v = randn(1, 512, 2, 64, seed=seed), randn(1, 512, 1, 64, seed=seed + 1), randn(1, 512, 1, 64, seed=seed + 2)
    channels = torch.tensor([3, 17, 40, 41])
    q[..., channels] *= 8
    k[..., channels] *= 8
    return q / 4, k, v


def test_error_against_fp32_beside_bf16_and_with_outlier_channels():
    q, k, v = randn(1, 512, 2, 64), randn(1, 512, 1, 64, seed=1), randn(1, 512, 1, 64, seed=2)
    exact = reference.attention(q, k, v)
    bf16_error = relative_error(reference.attention(q.bfloat16(), k.bfloat16(), v.bfloat16()), exact)
    fp8_error = relative_error(reference.fp8_attention(q, k, v), exact)
    assert 10 * bf16_error < fp8_error < 0.08
    # Outlier channels make the products' e4m3 error larger; the rotation spreads them and takes most of it back
    # (measured here: about 0.11 without, 0.045 with), while on random inputs (0.045) it changes little.
    q, k, v = outlier_inputs(seed=4)
    exact = reference.attention(q, k, v)
    outlier_error = relative_error(reference.fp8_attention(q, k, v), exact)
    rotated_error = relative_error(reference.fp8_attention(q, k, v, rotate=True), exact)
    assert outlier_error > 1.5 * fp8_error
    assert rotated_error < 0.6 * outlier_error
