"""Triton RoPE and SwiGLU (kernels/rope_triton.py, kernels/swiglu_triton.py) on CPU through Triton's interpreter,
against the fp32 reference: forward and every gradient, fp32 and fp16, odd shapes, packed-document positions, and
the model through the memory policy (recomputed layers, tiled MLP). (bf16 at real shapes: GPU only,
tests/test_rope_swiglu_gpu.py.)"""
import conftest_kernels  # first: interpreter or compiler settled before any kernels.* Triton module loads
from conftest_kernels import poisoned_empty  # noqa: F401  (fixture)

import zlib

import pytest
import torch

import kernels
from kernels import reference
from kernels.attention import choose_route
from kernels.rope_triton import rope
from kernels.swiglu_triton import swiglu
from model import CausalLM, DecoderConfig
from model.decoder import positions_from_documents
from model.rope import rope_tables as model_rope_tables
from offload.policy import apply_memory_policy
from trainer.build import install_attention_route

pytestmark = conftest_kernels.needs_interpreter

TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
# (batch, seqlen, q heads, kv heads, head dim): one token, heads and lengths that are not powers of two,
# GQA and MQA k, head dims 64 and 128 (and a tiny 6, whose half 3 is masked inside a block of 4).
ROPE_SHAPES = [(1, 1, 1, 1, 64), (2, 7, 3, 1, 64), (1, 33, 5, 5, 128), (3, 5, 12, 4, 128), (2, 9, 2, 2, 6)]
SWIGLU_SHAPES = [(1, 1), (1, 7), (3, 5, 33), (17, 1000), (2, 2100)]


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    kernels.set_backend("auto")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite (unwritten or NaN) values"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def rope_tables(position_ids: torch.Tensor, head_dim: int, dtype: torch.dtype, scaling=LLAMA3_SCALING):
    """cos/sin [B, S, 1, D] exactly as the model makes them (`model.rope.rope_tables`, llama3 scaling)."""
    cfg = DecoderConfig(vocab_size=8, hidden_size=head_dim, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, rope_theta=500000.0, rope_scaling=scaling)
    return model_rope_tables(cfg, position_ids, dtype)


def rope_case(q_leaf, k_leaf, cos, sin, dq, dk):
    """Our rotated q, k and their gradients, and the fp32 reference's, as (ours, reference) pairs."""
    q_out, k_out = rope(q_leaf, k_leaf, cos, sin)
    torch.autograd.backward((q_out, k_out), (dq, dk))
    q_ref, k_ref = (t.detach().float().requires_grad_() for t in (q_leaf, k_leaf))
    q_ref_out, k_ref_out = reference.rope(q_ref, k_ref, cos.float(), sin.float())
    torch.autograd.backward((q_ref_out, k_ref_out), (dq.float(), dk.float()))
    return [(q_out, q_ref_out), (k_out, k_ref_out), (q_leaf.grad, q_ref.grad), (k_leaf.grad, k_ref.grad)]


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rope_forward_and_gradients_match_reference(poisoned_empty, shape, dtype):
    batch, seqlen, q_heads, kv_heads, head_dim = shape
    torch.manual_seed(zlib.crc32(repr(shape).encode()))
    q = torch.randn(batch, seqlen, q_heads, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seqlen, kv_heads, head_dim, dtype=dtype, requires_grad=True)
    positions = torch.arange(seqlen).expand(batch, seqlen) * 997   # far positions: large angles
    cos, sin = rope_tables(positions, head_dim, dtype)
    for out, ref in rope_case(q, k, cos, sin, torch.randn_like(q), torch.randn_like(k)):
        assert out.dtype == dtype and out.shape == ref.shape
        assert relative_error(out, ref) < TOLERANCE[dtype]


def test_rope_packed_documents_restart_positions():
    """Packed [2, 12] block of documents of lengths 5, 1, 11, 7: each document's rotation is that of the
    same document alone at the start of a sequence."""
    torch.manual_seed(5)
    cu_seqlens = torch.tensor([0, 5, 6, 17, 24], dtype=torch.int32)
    positions = positions_from_documents(cu_seqlens, 2, 12)
    cos, sin = rope_tables(positions, 64, torch.float32)
    q, k = torch.randn(2, 12, 4, 64, requires_grad=True), torch.randn(2, 12, 2, 64, requires_grad=True)
    pairs = rope_case(q, k, cos, sin, torch.randn_like(q), torch.randn_like(k))
    for out, ref in pairs:
        assert relative_error(out, ref) < 1e-6
    q_flat, q_out_flat = q.detach().reshape(24, 4, 64), pairs[0][0].detach().reshape(24, 4, 64)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        alone_cos, alone_sin = rope_tables(torch.arange(end - start)[None], 64, torch.float32)
        alone, _ = reference.rope(q_flat[None, start:end], torch.zeros(1, end - start, 1, 64), alone_cos, alone_sin)
        assert relative_error(q_out_flat[start:end], alone[0]) < 1e-6


def test_rope_reads_any_layout_and_never_writes_its_inputs():
    """q as a transposed [B, H, S, D] buffer (as transformers lays it out), k as a slice of a wider one,
    gradients from `.sum()` (stride 0): all read through their strides; inputs and the caller's gradient
    tensors are left as they were."""
    torch.manual_seed(6)
    q_leaf = torch.randn(2, 3, 6, 64).transpose(1, 2).requires_grad_()
    k_leaf = torch.randn(2, 6, 3, 64)[:, :, 1:2].requires_grad_()
    cos, sin = rope_tables(torch.arange(6).expand(2, 6), 64, torch.float32)
    inputs = q_leaf.detach().clone(), k_leaf.detach().clone()
    q_out, k_out = rope(q_leaf, k_leaf, cos, sin)
    (q_out.sum() + 2 * k_out.sum()).backward()
    q_ref, k_ref = (t.detach().clone().requires_grad_() for t in (q_leaf, k_leaf))
    q_ref_out, k_ref_out = reference.rope(q_ref, k_ref, cos, sin)
    (q_ref_out.sum() + 2 * k_ref_out.sum()).backward()
    for out, ref in ((q_out, q_ref_out), (k_out, k_ref_out), (q_leaf.grad, q_ref.grad), (k_leaf.grad, k_ref.grad)):
        assert relative_error(out, ref) < 1e-6
    assert torch.equal(q_leaf, inputs[0]) and torch.equal(k_leaf, inputs[1])
    dq, dk = torch.randn(2, 6, 3, 64), torch.randn(2, 6, 1, 64)
    kept = dq.clone(), dk.clone()
    torch.autograd.backward(rope(q_leaf, k_leaf, cos, sin), (dq, dk))
    assert torch.equal(dq, kept[0]) and torch.equal(dk, kept[1])


def test_nan_is_never_hidden():
    q, k = torch.randn(1, 3, 2, 64), torch.randn(1, 3, 1, 64)
    q[0, 1, 1, 5] = float("nan")
    cos, sin = rope_tables(torch.arange(3)[None], 64, torch.float32)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out[0, 1, 1].isnan().any() and not q_out[0, 0].isnan().any() and not k_out.isnan().any()
    gate = torch.randn(2, 5)
    gate[1, 3] = float("nan")
    assert swiglu(gate, torch.randn(2, 5)).isnan().sum() == 1
    with pytest.raises(AssertionError, match="non-finite"):
        relative_error(q_out, q_out.nan_to_num())


def test_rope_clear_errors():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
    cos, sin = rope_tables(torch.arange(4)[None], 8, torch.float32)
    with pytest.raises(ValueError, match="same B, S and D"):
        rope(q, torch.randn(1, 4, 1, 6), cos, sin)
    with pytest.raises(ValueError, match="head dim must be even"):
        rope(torch.randn(1, 4, 2, 7), torch.randn(1, 4, 1, 7), cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match=r"cos must be \[1, 4, 1, 8\]"):
        rope(q, k, cos[:, :3], sin)
    with pytest.raises(ValueError, match="takes no gradient"):
        rope(q, k, cos.requires_grad_(), sin)


@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_swiglu_forward_and_gradients_match_reference(poisoned_empty, shape, dtype):
    torch.manual_seed(zlib.crc32(repr(shape).encode()))
    gate = (3 * torch.randn(shape)).to(dtype).requires_grad_()   # into silu's tails on both sides
    up = torch.randn(shape, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, dtype=dtype)
    y = swiglu(gate, up)
    y.backward(dy)
    gate_ref, up_ref = (t.detach().float().requires_grad_() for t in (gate, up))
    y_ref = reference.swiglu(gate_ref, up_ref)
    y_ref.backward(dy.float())
    for out, ref in ((y, y_ref), (gate.grad, gate_ref.grad), (up.grad, up_ref.grad)):
        assert out.dtype == dtype and out.shape == ref.shape
        assert relative_error(out, ref) < TOLERANCE[dtype]


def test_swiglu_strided_halves_of_one_projection_and_expanded_gradient():
    """gate and up as the two halves of one [N, 2I] tensor (row stride 2I), dy from .sum() (stride 0)."""
    torch.manual_seed(7)
    fused = torch.randn(9, 2 * 40, requires_grad=True)
    gate, up = fused[:, :40], fused[:, 40:]
    swiglu(gate, up).sum().backward()
    fused_ref = fused.detach().clone().requires_grad_()
    reference.swiglu(fused_ref[:, :40], fused_ref[:, 40:]).sum().backward()
    assert relative_error(fused.grad, fused_ref.grad) < 1e-6


def test_swiglu_clear_errors():
    with pytest.raises(ValueError, match="one row stride"):
        swiglu(torch.randn(8, 5).t(), torch.randn(8, 5).t())
    with pytest.raises(TypeError, match="share one of"):
        swiglu(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="one non-empty shape"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))


def test_dispatch_runs_triton_when_asked():
    kernels.set_backend("triton")
    cos, sin = rope_tables(torch.arange(3)[None], 64, torch.float32)
    q, k = torch.randn(1, 3, 2, 64), torch.randn(1, 3, 1, 64)
    expected = reference.rope(q, k, cos, sin)
    for out, ref in zip(kernels.rope(q, k, cos, sin), expected):
        assert relative_error(out, ref) < 1e-6
    gate, up = torch.randn(4, 10), torch.randn(4, 10)
    assert relative_error(kernels.swiglu(gate, up), reference.swiglu(gate, up)) < 1e-6


def test_model_with_fused_ops_through_the_memory_policy():
    """The tiny Llama (GQA, llama3 scaling, packed documents) with Triton RoPE and SwiGLU under per-layer
    recomputation and a 3-tile MLP equals the reference model under plain autograd. Attention stays the
    reference: head dim 16 is not one the Triton attention takes."""
    torch.manual_seed(0)
    model = CausalLM.from_config(dict(vocab_size=64, hidden_size=64, intermediate_size=100, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, rope_scaling=LLAMA3_SCALING))
    input_ids, labels = torch.randint(0, 64, (2, 20)), torch.randint(0, 64, (2, 20))
    cu_seqlens = torch.tensor([0, 13, 14, 40], dtype=torch.int32)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model.loss(model(input_ids, cu_seqlens=cu_seqlens), labels)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    kernels.set_backend("reference")
    expected = loss_and_grads()
    kernels.set_backend("triton")
    install_attention_route(model, choose_route(torch.device("cpu"), 16, "reference"))
    policy = apply_memory_policy(model, ["gpu", "recompute", "host"], 3, torch.device("cpu"))
    measured = loss_and_grads()
    policy.remove()
    for out, ref in zip(measured, expected):
        assert relative_error(out, ref) < 1e-5


def test_swiglu_launch_tuning_arguments_keep_the_results():
    """block and num_warps (what scripts/bench_kernels.py --sweep varies) reach the launches: a block
    smaller than a row splits it across programs, with the same values."""
    torch.manual_seed(8)
    gate, up = torch.randn(3, 70, requires_grad=True), torch.randn(3, 70, requires_grad=True)
    y = swiglu(gate, up, block=16, num_warps=1)
    grads = torch.autograd.grad(y.sum(), (gate, up))
    y_ref = reference.swiglu(gate, up)
    for out, ref in zip((y, *grads), (y_ref, *torch.autograd.grad(y_ref.sum(), (gate, up)))):
        assert relative_error(out, ref) < 1e-6
