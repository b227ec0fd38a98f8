"""Triton RoPE and SwiGLU at Llama-3 8B's shapes in bf16 on a CUDA GPU, against the fp32 reference.

Skipped without CUDA, and under TRITON_INTERPRET=1 (tests/conftest.py sets it on a machine without a GPU,
and compiles on one with a GPU unless told).
"""
from types import SimpleNamespace

import conftest_kernels
import torch

from kernels import reference
from model import DecoderConfig
from model.decoder import positions_from_documents
from model.rope import rope_tables

pytestmark = conftest_kernels.needs_compiled_gpu

TOKENS = 32768


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_rope_bf16_llama3_shape_with_packed_documents():
    """32 q heads, 8 kv heads, D=128, 32k tokens of packed documents, Llama-3.1's scaled tables in bf16."""
    from kernels.rope_triton import rope
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=8, hidden_size=4096, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cu_seqlens = torch.tensor([0, 1000, 9000, 9001, TOKENS], dtype=torch.int32, device="cuda")
    cos, sin = rope_tables(cfg, positions_from_documents(cu_seqlens, 1, TOKENS), torch.bfloat16)
    q = torch.randn(1, TOKENS, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, TOKENS, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    torch.autograd.backward(out := rope(q, k, cos, sin), (dq, dk))
    q_ref, k_ref = (t.detach().float().requires_grad_() for t in (q, k))
    torch.autograd.backward(ref := reference.rope(q_ref, k_ref, cos, sin), (dq.float(), dk.float()))
    errors = [relative_error(a, b) for a, b in zip((*out, q.grad, k.grad), (*ref, q_ref.grad, k_ref.grad))]
    print("relative errors q, k, dq, dk:", errors)
    assert max(errors) < 5e-3


def test_swiglu_bf16_llama3_mlp_shape():
    """[32768, 14336] bf16: the intermediate of Llama-3 8B's MLP at 32k tokens."""
    from kernels.swiglu_triton import swiglu
    torch.manual_seed(0)
    gate = (2 * torch.randn(TOKENS, 14336, device="cuda")).to(torch.bfloat16).requires_grad_()
    up = torch.randn(TOKENS, 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(up)
    y = swiglu(gate, up)
    y.backward(dy)
    gate_ref, up_ref = (t.detach().float().requires_grad_() for t in (gate, up))
    y_ref = reference.swiglu(gate_ref, up_ref)
    y_ref.backward(dy.float())
    errors = [relative_error(a, b) for a, b in ((y, y_ref), (gate.grad, gate_ref.grad), (up.grad, up_ref.grad))]
    print("relative errors y, dgate, dup:", errors)
    assert max(errors) < 5e-3


def test_swiglu_under_autocast_in_a_tiled_mlp():
    """The model's MLP (bf16 autocast over fp32 weights, as full fine-tuning's fp32 layout) run through the
    tiled MLP policy, against the same MLP in fp32 without tiles."""
    import kernels
    from model.decoder import MLP
    from offload.policy import TokenTiled
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=4096, intermediate_size=14336)
    mlp = MLP(cfg).cuda()
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        torch.nn.init.normal_(linear.weight, std=0.02)
    x = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    anchor = torch.empty(0, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = TokenTiled.apply(anchor, x, mlp.forward, 3)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    grads = [x.grad] + [p.grad for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    kernels.set_backend("reference")
    try:
        mlp(x).square().mean().backward()
    finally:
        kernels.set_backend("auto")
    for ours, ref in zip(grads, [x.grad] + [p.grad for p in mlp.parameters()]):
        assert relative_error(ours, ref) < 2e-2
