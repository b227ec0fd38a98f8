"""FP8 (model/fp8.py) on a GPU with FP8 tensor cores, compiled: the Triton row quantizer against its reference at
real shapes, cuBLAS's FP8 product against the reference product, the FP8 projection's forward and input
gradient against the reference backend, and a LoRA step's loss and adapter gradients against bf16.

Skipped without a CUDA GPU of compute capability 9.0 or more (Hopper), and under TRITON_INTERPRET=1.
"""
import contextlib
import copy
from types import SimpleNamespace

import conftest_kernels
from conftest_kernels import poisoned_empty  # noqa: F401  (a fixture)
import pytest
import torch

import kernels
from kernels import reference

pytestmark = [conftest_kernels.needs_compiled_gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs Hopper FP8 tensor cores (compute capability 9.0+)")]

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("rows,cols,strided,with_column_scale", [
    (32768, 4096, False, False), (8192, 14336, False, True), (1001, 4112, True, True), (3, 16, False, False)])
def test_quantizer_matches_reference_bit_for_bit(rows, cols, strided, with_column_scale, poisoned_empty):
    """Same scales and the same e4m3 bytes as the reference (both round to nearest in fp32), odd shapes, a
    strided input, column scales; the output is poisoned, so an element never written fails."""
    from kernels.quantize_rows_triton import quantize_rows
    torch.manual_seed(0)
    source = torch.randn(rows, cols + 64 * strided, device="cuda", dtype=torch.bfloat16)
    source *= torch.logspace(-4, 2, rows, device="cuda").to(torch.bfloat16)[:, None]
    x = source[:, :cols]
    column_scale = torch.rand(cols, device="cuda") + 0.5 if with_column_scale else None
    q, scale = quantize_rows(x, column_scale)
    q_ref, scale_ref = reference.quantize_rows(x, column_scale)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_quantizer_poisons_rows_with_inf_or_nan():
    from kernels.quantize_rows_triton import quantize_rows
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    x[1, 7], x[2, 100] = float("inf"), float("nan")
    q, scale = quantize_rows(x)
    assert torch.isnan(scale[1:3]).all() and torch.isfinite(scale[[0, *range(3, 16)]]).all()
    out = kernels.scaled_matmul(q, scale, q, scale, torch.bfloat16)
    assert torch.isnan(out[1:3]).all() and torch.isfinite(out[0, [0, *range(3, 16)]]).all()


@pytest.mark.parametrize("rows,cols", [(14336, 4096), (4096, 14336), (1000, 4112), (1, 16)])
def test_transpose_matches_reference(rows, cols, poisoned_empty):
    x = torch.randn(rows, cols, device="cuda").to(torch.float8_e4m3fn)
    assert torch.equal(kernels.transpose(x).view(torch.uint8), x.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("tokens,in_features,out_features", [(32768, 4096, 1024), (4096, 14336, 4096)])
def test_cublas_product_matches_reference(tokens, in_features, out_features):
    """cuBLAS accumulates the exact e4m3 products in fp32 in another order than the reference: the two differ by
    the bf16 output's rounding (2^-9 relative) and little more."""
    torch.manual_seed(0)
    a, a_scale = reference.quantize_rows(torch.randn(tokens, in_features, device="cuda"))
    b, b_scale = reference.quantize_rows(torch.randn(out_features, in_features, device="cuda") * 0.02)
    out = kernels.scaled_matmul(a, a_scale, b, b_scale, torch.bfloat16)
    ref = reference.scaled_matmul(a, a_scale, b, b_scale, torch.float32)
    assert relative_error(out, ref) < 3e-3


def test_fp8_projection_matches_reference_backend():
    """Forward and input gradient of an Fp8Linear, compiled kernels and cuBLAS against the reference ops."""
    from model.fp8 import Fp8Linear
    torch.manual_seed(0)
    linear = torch.nn.Linear(4096, 14336, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    fp8 = Fp8Linear(linear)
    x = torch.randn(2, 4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 4096, 14336, device="cuda", dtype=torch.bfloat16)
    out = fp8(x)
    out.backward(grad)
    x_ref = x.detach().clone().requires_grad_(True)
    kernels.set_backend("reference")
    try:
        out_ref = fp8(x_ref)
        out_ref.backward(grad)
    finally:
        kernels.set_backend("auto")
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert relative_error(out, out_ref) < 3e-3
    assert relative_error(x.grad, x_ref.grad) < 3e-3


def test_lora_step_against_bf16():
    """One LoRA forward and backward of a 2-layer model of Llama-3-8B's widths, from the same weights: the fp32
    model (no autocast) is the reference; bf16 (autocast, bf16 base) and FP8 (the same with an FP8 base) are
    measured against it. FP8's loss stays within 0.1% of fp32's, and each adapter gradient's error within 12
    times bf16's own: e4m3 keeps 3 mantissa bits to bf16's 7, 16 times the rounding (measured on the H200: 9
    times, 0.22-0.42 against 0.024-0.047, through two layers' FP8 products)."""
    from model import CausalLM
    from model.fp8 import quantize_frozen_base
    from trainer.build import lora_model
    from trainer.step import autocast
    torch.manual_seed(0)
    arch = dict(vocab_size=4096, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
    train = SimpleNamespace(lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_modules=LORA_TARGETS)
    fp32 = lora_model(CausalLM.from_config(arch, dtype=torch.float32, device="cuda"), train)
    for name, parameter in fp32.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    bf16 = copy.deepcopy(fp32)
    for name, parameter in bf16.named_parameters():
        if not parameter.requires_grad:
            parameter.data = parameter.data.to(torch.bfloat16)
    fp8 = copy.deepcopy(bf16)
    quantize_frozen_base(fp8)
    ids = torch.randint(0, 4096, (1, 8192), device="cuda")
    labels = torch.roll(ids, -1, 1)
    losses, grads = {}, {}
    for name, model in (("fp32", fp32), ("bf16", bf16), ("fp8", fp8)):
        with autocast(torch.device("cuda")) if name != "fp32" else contextlib.nullcontext():
            loss = model.base_model.model.loss(model(ids), labels)
        loss.backward()
        losses[name] = loss.item()
        grads[name] = {key: p.grad for key, p in model.named_parameters() if p.requires_grad}
    errors = {name: {key: relative_error(grads[name][key], grads["fp32"][key]) for key in grads["fp32"]}
              for name in ("bf16", "fp8")}
    assert abs(losses["fp8"] - losses["fp32"]) / losses["fp32"] < 1e-3
    for key in grads["fp32"]:
        assert errors["fp8"][key] < 12 * errors["bf16"][key], (key, errors["fp8"][key], errors["bf16"][key])
