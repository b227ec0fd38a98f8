"""The byte model of a "full" layer equals what autograd keeps for it: one decoder layer's forward with grad,
its saved tensors counted through saved-tensor hooks (Triton attention, interpreted on CPU, fp32). A model
change that keeps more fails here."""
import conftest_kernels  # noqa: F401  (before anything imports Triton)

from types import SimpleNamespace

import pytest
import torch

import kernels
from conf.schema.job import triton_interpreting
from model import Llama, LlamaConfig
from offload.byte_model import Shape, full_layer_bytes
from offload.policy import apply_memory_policy
from trainer.build import apply_lora

# head dim 64 (a size the Triton attention takes), grouped-query attention, an MLP wider than the model
SHAPE = dict(vocab_size=96, hidden_size=128, intermediate_size=160, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, rope_theta=10000.0)
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = 32


def kept_bytes(model, tiles: int) -> int:
    """Bytes of the distinct storages autograd saves in layer 0's forward, less parameters and RoPE tables
    (shared by every layer and counted by the planner on their own)."""
    apply_memory_policy(model, None, tiles, torch.device("cpu"))
    decoder = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    hidden = torch.randn(1, TOKENS, SHAPE["hidden_size"], requires_grad=True)
    rope = decoder.rope(torch.arange(TOKENS)[None], hidden.dtype)
    shared = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *rope)}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in shared:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        decoder.layers[0](hidden, rope, torch.tensor([0, 10, TOKENS], dtype=torch.int32))
    return sum(saved.values())


@pytest.mark.skipif(not triton_interpreting(), reason="the Triton attention on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("mode, dropout, targets", [("lora", 0.0, ALL_SEVEN), ("lora", 0.3, ALL_SEVEN),
                                                    ("lora", 0.0, ["q_proj", "v_proj", "down_proj"]),
                                                    ("full", 0.0, [])],
                         ids=["lora", "lora-dropout", "lora-some", "full"])
@pytest.mark.parametrize("tiles", [1, 2], ids=["untiled", "tiled"])
def test_full_layer_bytes_equal_what_autograd_keeps(mode, dropout, targets, tiles):
    kernels.set_backend("triton")
    try:
        torch.manual_seed(0)
        model = Llama.from_config(LlamaConfig(**SHAPE))
        train = SimpleNamespace(mode=mode, lora_r=4, lora_alpha=8.0, lora_dropout=dropout, lora_target_modules=targets)
        if mode == "lora":
            model = apply_lora(model, train)
        measured = kept_bytes(model, tiles)
    finally:
        kernels.set_backend("auto")
    assert measured == full_layer_bytes(Shape(LlamaConfig(**SHAPE), TOKENS, 4), train, tiles > 1, "cpu")


def test_a_full_llama3_8b_lora_layer_keeps_six_and_a_half_activations():
    shape = Shape(LlamaConfig(), 32768, 2)
    lora = SimpleNamespace(mode="lora", lora_r=16, lora_dropout=0.0, lora_target_modules=ALL_SEVEN)
    small = 32768 * (4 * (2 + 32) + 8 + 4 * 16 * 2)          # rstds, lse, document bounds, four adapters' [r]
    assert full_layer_bytes(shape, lora, mlp_tiled=True) == 6.5 * shape.activation + small
