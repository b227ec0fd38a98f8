"""model/lora.py: the fused adapter forward computes peft's LoRA (forward and every gradient) without the
[tokens, out_features] multiply and add, and hands back to peft where peft does more."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import CausalLM, DecoderConfig
from model.lora import FusedAdapterForward, fuse_adapter_products
from trainer.build import apply_lora

CFG = DecoderConfig(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = apply_lora(CausalLM.from_config(CFG, dtype=torch.float32, device="cpu"),
                       SimpleNamespace(lora_r=4, lora_alpha=8.0, lora_dropout=dropout, lora_target_modules=TARGETS))
    for name, param in model.named_parameters():
        if "lora_B" in name:          # peft starts B at zero, which would hide a wrong up-projection
            torch.nn.init.normal_(param, std=0.5)
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)              # the same dropout masks in both models
    hidden = model(ids)
    loss = (hidden.float() ** 2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_equals_peft_forward_and_gradients(dropout):
    plain = lora_model(dropout)
    fused = copy.deepcopy(plain)
    assert fuse_adapter_products(fused) == 7 * CFG.num_hidden_layers
    ids = torch.randint(0, CFG.vocab_size, (2, 17))
    loss, grads = loss_and_grads(plain, ids)
    fused_loss, fused_grads = loss_and_grads(fused, ids)
    assert torch.isfinite(fused_loss) and relative_error(fused_loss, loss) < 1e-6
    assert fused_grads.keys() == grads.keys() and len(grads) == 2 * 7 * CFG.num_hidden_layers
    for name, grad in grads.items():
        assert relative_error(fused_grads[name], grad) < 1e-5, name


class OutputSizes(TorchDispatchMode):
    """Records (op, output numel) of every op that runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.ops.append((str(func.overloadpacket), out.numel()))
        return out


def projection_sized_elementwise_ops(forward, x) -> list[str]:
    with OutputSizes() as seen:
        forward(x).sum().backward()
    return [op for op, numel in seen.ops
            if numel == x.shape[0] * CFG.intermediate_size and op in ("aten.mul", "aten.add")]


def test_no_elementwise_pass_over_the_projection_output():
    layer = lora_model().base_model.model.model.layers[0].mlp.gate_proj
    x = torch.randn(64, CFG.hidden_size, requires_grad=True)
    # peft: the scaling multiply and the add in the forward, the scaling multiply again in the backward.
    assert len(projection_sized_elementwise_ops(layer.forward, x)) >= 2
    assert projection_sized_elementwise_ops(FusedAdapterForward(layer), x) == []


def test_hands_back_to_peft_when_adapters_are_disabled():
    model = lora_model()
    fuse_adapter_products(model)
    base_only = copy.deepcopy(model)
    for name, param in base_only.named_parameters():
        if "lora_B" in name:
            param.data.zero_()
    ids = torch.randint(0, CFG.vocab_size, (1, 9))
    with torch.no_grad():
        with model.disable_adapter():
            disabled = model(ids)
        active, expected_base = model(ids), base_only(ids)
    assert relative_error(disabled, expected_base) < 1e-6
    assert relative_error(active, expected_base) > 1e-3      # the adapters act again outside the context


def test_mixed_dtypes_outside_autocast_go_to_peft():
    layer = lora_model().base_model.model.model.layers[0].mlp.gate_proj
    layer.base_layer.to(torch.bfloat16)                   # a bf16 base with fp32 adapters, no autocast
    x = torch.randn(8, CFG.hidden_size, dtype=torch.bfloat16)
    expected = layer.forward(x)
    assert torch.equal(FusedAdapterForward(layer)(x), expected)
