"""The byte model of a "full" layer equals what autograd keeps for it: one decoder layer's forward with grad,
its saved tensors counted through saved-tensor hooks (Triton attention, interpreted on CPU), in fp32 and as
the trainer runs LoRA on a GPU (bf16 base, fp32 adapters, bf16 autocast). A model change that keeps more
fails here."""
import conftest_kernels  # first: interpreter or compiler settled before anything imports Triton

from types import SimpleNamespace

import pytest
import torch

import kernels
from model import CausalLM, DecoderConfig
from model.family import projection_shapes
from offload.byte_model import Shape, full_layer_bytes
from offload.policy import apply_memory_policy
from trainer.build import apply_lora, lora_model

# head dim 64 (a size the Triton attention takes), grouped-query attention, an MLP wider than the model
SHAPE = dict(vocab_size=96, hidden_size=128, intermediate_size=160, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, rope_theta=10000.0)
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = 32


def kept_bytes(model, tiles: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the distinct storages autograd saves in layer 0's forward (under bf16 autocast for a bf16
    `dtype`, as trainer.step runs on a GPU), less parameters and RoPE tables (shared by every layer and
    counted by the planner on their own)."""
    apply_memory_policy(model, None, tiles, torch.device("cpu"))
    decoder = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    hidden = torch.randn(1, TOKENS, SHAPE["hidden_size"], dtype=dtype, requires_grad=True)
    rope = decoder.rope(torch.arange(TOKENS)[None], hidden.dtype)
    shared = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *rope)}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in shared:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
          torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)):
        decoder.layers[0](hidden, rope, torch.tensor([0, 10, TOKENS], dtype=torch.int32))
    return sum(saved.values())


LORA_CASES = [("lora", 0.0, ALL_SEVEN), ("lora", 0.3, ALL_SEVEN), ("lora", 0.0, ["q_proj", "v_proj", "down_proj"])]
LORA_IDS = ["lora", "lora-dropout", "lora-some"]


def measured_layer(build, tiles: int, dtype: torch.dtype, arch: DecoderConfig | None = None) -> int:
    kernels.set_backend("triton")
    try:
        torch.manual_seed(0)
        model = CausalLM.from_config(arch or DecoderConfig(**SHAPE), dtype=dtype)
        return kept_bytes(build(model), tiles, dtype)
    finally:
        kernels.set_backend("auto")


def lora_config(dropout: float, targets: list[str]) -> SimpleNamespace:
    return SimpleNamespace(mode="lora", lora_r=4, lora_alpha=8.0, lora_dropout=dropout, lora_target_modules=targets)


@conftest_kernels.needs_interpreter
@pytest.mark.parametrize("mode, dropout, targets", [*LORA_CASES, ("full", 0.0, [])], ids=[*LORA_IDS, "full"])
@pytest.mark.parametrize("tiles", [1, 2], ids=["untiled", "tiled"])
def test_full_layer_bytes_equal_what_autograd_keeps(mode, dropout, targets, tiles):
    """fp32 without autocast, with peft's own adapter forward."""
    train = lora_config(dropout, targets) if mode == "lora" else SimpleNamespace(mode="full")
    measured = measured_layer(lambda model: apply_lora(model, train) if mode == "lora" else model, tiles,
                              torch.float32)
    assert measured == full_layer_bytes(Shape(DecoderConfig(**SHAPE), TOKENS, 4), train, tiles > 1, "cpu")


@conftest_kernels.needs_interpreter
@pytest.mark.parametrize("dropout, targets", [case[1:] for case in LORA_CASES], ids=LORA_IDS)
@pytest.mark.parametrize("tiles", [1, 2], ids=["untiled", "tiled"])
def test_full_layer_bytes_equal_what_autograd_keeps_as_the_trainer_runs_lora_on_a_gpu(dropout, targets, tiles):
    """As trainer.build builds LoRA on CUDA (bf16 base, fp32 adapters with the fused adapter forward, their
    inputs left in bf16) under bf16 autocast: the planner's 32k plan fills 72.1 of 72.45 GiB with this count.
    Autocast's bf16 copies of the adapter weights are kept too; the fp32 copy of every adapter input that
    peft would make without keep_adapter_inputs_in_bf16 would fail this."""
    train = lora_config(dropout, targets)
    measured = measured_layer(lambda model: lora_model(model, train), tiles, torch.bfloat16)
    assert measured == full_layer_bytes(Shape(DecoderConfig(**SHAPE), TOKENS, 2), train, tiles > 1, "cpu")


def test_a_full_llama3_8b_lora_layer_keeps_six_and_a_half_activations():
    shape = Shape(DecoderConfig(), 32768, 2)
    lora = SimpleNamespace(mode="lora", lora_r=16, lora_dropout=0.0, lora_target_modules=ALL_SEVEN)
    small = 32768 * (4 * (2 + 32) + 8 + 4 * 16 * 2)          # rstds, lse, document bounds, four adapters' [r]
    attention = projection_shapes(shape.arch)
    adapter_copies = 2 * 16 * sum(sum(attention[name]) for name in ALL_SEVEN[:4])    # bf16, 0.8 MiB
    assert full_layer_bytes(shape, lora, mlp_tiled=True) == 6.5 * shape.activation + small + adapter_copies


# Qwen3's layer: QK-norm over heads of 64 whose width (4 x 64) is not the residual's (128).
QWEN3 = dict(SHAPE, family="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@conftest_kernels.needs_interpreter
@pytest.mark.parametrize("mode, dtype, tiles", [("full", torch.float32, 1), ("lora", torch.float32, 2),
                                                ("lora", torch.bfloat16, 1)],
                         ids=["full", "lora-tiled", "lora-as-on-a-gpu"])
def test_a_qwen3_full_layer_keeps_what_the_byte_model_counts(mode, dtype, tiles):
    """QK-norm's inputs and rstds (model.family.saved_by_qk_norm) beside the rest of the layer."""
    train = lora_config(0.0, ALL_SEVEN) if mode == "lora" else SimpleNamespace(mode="full")
    wrap = apply_lora if dtype == torch.float32 else lora_model
    build = (lambda model: wrap(model, train)) if mode == "lora" else (lambda model: model)
    arch = DecoderConfig(**QWEN3)
    measured = measured_layer(build, tiles, dtype, arch)
    act = 4 if dtype == torch.float32 else 2
    assert measured == full_layer_bytes(Shape(arch, TOKENS, act), train, tiles > 1, "cpu")
    without_qk_norm = full_layer_bytes(Shape(DecoderConfig(**{**QWEN3, "family": "llama"}), TOKENS, act), train,
                                       tiles > 1, "cpu")
    assert measured - without_qk_norm == TOKENS * (4 + 2) * (64 * act + 4)


def test_a_layer_backward_counts_q_and_the_attention_output_at_their_own_width():
    """Qwen3-4B's 32 heads of 128 are wider than its 2560-wide residual: q, the attention output and their
    gradients in a layer's backward (and q, its rotation and the output in an evaluation's forward) are
    counted at 4096, not 2560."""
    import dataclasses

    from offload.byte_model import _layer_backward, eval_forward_bytes
    wide = DecoderConfig(family="qwen3", hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128)
    as_wide_as_hidden = dataclasses.replace(wide, num_attention_heads=20, num_key_value_heads=4)  # 20 x 128 = 2560
    tokens, act = 32768, 2
    from model.family import saved_by_qk_norm
    qk_norm_difference = 2 * tokens * (saved_by_qk_norm(wide, act) - saved_by_qk_norm(as_wide_as_hidden, act))
    backward = [_layer_backward(Shape(arch, tokens, act), tokens, "flash")["layer backward activations"]
                for arch in (wide, as_wide_as_hidden)]
    assert backward[0] - backward[1] == 4 * tokens * 12 * 128 * act + qk_norm_difference
    evaluation = [eval_forward_bytes(Shape(arch, tokens, act), tokens) for arch in (wide, as_wide_as_hidden)]
    assert evaluation[0] - evaluation[1] == 3 * tokens * 12 * 128 * act + tokens * 12 * 4
