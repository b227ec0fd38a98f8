"""What a model family is to the trainer: one `ModelFamily` value per family (model/families/), which every
other layer reads instead of knowing an architecture by name.

All families share one decoder (model/decoder.py: RMSNorm, attention with RoPE, SwiGLU MLP, transformers'
parameter names); a family says which of the shared layer's options it uses (`LayerOps`), how its
config.json is spelled (model types, class names, the keys and defaults that differ from Llama's) and what
it refuses to load. From that, `projection_shapes`, `bias_shapes`, `norm_shapes` and `saved_by_qk_norm` give
the planner (offload/byte_model.py) the layer's parameters and what its ops keep for the backward, and the checkpoint
loader, the export, FP8, LoRA, sharding and the memory policy walk the same modules whatever the family.
Adding a family that reuses the shared ops is one module in model/families/ and one entry in the registry
there (model/families/__init__.py; docs/ARCHITECTURE.md, "Adding a model family").
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LayerOps:
    """The shared decoder layer's optional ops a family uses."""
    # RMSNorm over each head of q and k after their projections, before RoPE (Qwen3's "QK-norm").
    qk_norm: bool = False
    # A bias on the q, k and v projections (not o: Qwen2/2.5), trained and exported with them.
    qkv_bias: bool = False


@dataclass(frozen=True)
class ModelFamily:
    """One model family: how its Hugging Face checkpoints are recognised, read and written, and its layer."""
    name: str                                   # model.family, recorded in config.yaml and checkpoints
    model_types: tuple[str, ...]                # config.json `model_type` values it loads
    hf_architecture: str                        # config.json `architectures` of an export (transformers' class)
    layer: LayerOps = LayerOps()
    # config.json values a checkpoint may leave out, where the family's transformers config class defaults
    # differently from DecoderConfig's own defaults (Llama-3 8B's).
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # Fixed config.json keys an export writes (the options of transformers' class this decoder builds).
    hf_constants: Mapping[str, Any] = field(default_factory=dict)
    # config.json keys that must hold these values, or the checkpoint is refused (options not built here).
    required: Mapping[str, Any] = field(default_factory=dict)

    def refusal(self, values: Mapping[str, Any]) -> str | None:
        """Why a config.json of this family cannot be built (an option this decoder lacks), or None."""
        for key, wanted in self.required.items():
            if values.get(key) is not None and values[key] != wanted:
                return f"{key}={values[key]!r} is not supported for {self.name} (only {wanted!r} is built)"
        return None


def active_sliding_window(values: Mapping[str, Any]) -> int | None:
    """The attention window a config.json switches on, or None. Qwen2/2.5/3 keep `sliding_window` with
    `use_sliding_window: false` (off); transformers 5 lists each layer's kind in `layer_types`; Mistral v0.1,
    Ministral and Gemma 2/3 set `sliding_window` alone (on)."""
    window = values.get("sliding_window")
    if not window or values.get("use_sliding_window") is False:
        return None
    layer_types = values.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    # Qwen2/3 files without layer_types window the layers from max_window_layers on (transformers' rule).
    if layer_types is None and values.get("use_sliding_window") and \
            values.get("max_window_layers", 0) >= values.get("num_hidden_layers", 0) > 0:
        return None
    return int(window)


def sliding_window_refusal(values: Mapping[str, Any]) -> str | None:
    """Why a config.json with windowed attention is refused (whatever its family), or None."""
    window = active_sliding_window(values)
    if window is None:
        return None
    return (f"its attention is windowed (sliding_window={window}), and only full causal attention is built here: "
            f"training it would attend past the window the model was trained with")


def projection_shapes(arch) -> dict[str, tuple[int, int]]:
    """(input, output) width of each of a decoder layer's projections (`arch`: a DecoderConfig), by the names
    peft's LoRA targets (train.lora_target_modules) in every family."""
    d, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, arch.intermediate_size), "up_proj": (d, arch.intermediate_size),
            "down_proj": (arch.intermediate_size, d)}


def bias_shapes(arch) -> dict[str, int]:
    """The width of each of a decoder layer's projection biases (none but with LayerOps.qkv_bias)."""
    if not arch.ops.qkv_bias:
        return {}
    shapes = projection_shapes(arch)
    return {name: shapes[name][1] for name in ("q_proj", "k_proj", "v_proj")}


def norm_shapes(arch) -> dict[str, int]:
    """The width of each of a decoder layer's RMSNorm weights."""
    norms = {"input_layernorm": arch.hidden_size, "post_attention_layernorm": arch.hidden_size}
    if arch.ops.qk_norm:
        norms |= {"self_attn.q_norm": arch.head_dim, "self_attn.k_norm": arch.head_dim}
    return norms


def saved_by_qk_norm(arch, act_bytes: int) -> int:
    """Per-token bytes QK-norm keeps for its backward (kernels.rms_norm saves its input and an fp32 rstd per
    row, a row being one head of one token): q's and k's projections before the norm. 0 without it."""
    if not arch.ops.qk_norm:
        return 0
    heads = arch.num_attention_heads + arch.num_key_value_heads
    return heads * (arch.head_dim * act_bytes + 4)

