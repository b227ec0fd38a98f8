"""Llama architecture hyper-parameters, with the field names of transformers' LlamaConfig."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "llama3")


@dataclass
class LlamaConfig:
    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} as in Llama-3.1's config.json.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
            self.rope_scaling["rope_type"] = rope_type

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "LlamaConfig":
        """Build from an HF config.json dict (v4 `rope_scaling` or v5 `rope_parameters`) or our own fields."""
        values = dict(values)
        if values.get("attention_bias") or values.get("mlp_bias"):
            raise ValueError("Llama checkpoints with attention_bias or mlp_bias are not supported")
        if values.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {values['hidden_act']!r} is not supported; Llama uses 'silu'")
        rope_parameters = values.pop("rope_parameters", None)
        if rope_parameters:
            values.setdefault("rope_theta", rope_parameters.get("rope_theta", cls.rope_theta))
            if rope_parameters.get("rope_type", "default") != "default":
                values["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """The HF-style dict that peft and loggers read as `model.config`."""
        return self.to_hf_dict()

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_hf_dict().get(key, default)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents that transformers' LlamaForCausalLM loads."""
        values = dataclasses.asdict(self)
        values.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                      attention_bias=False, mlp_bias=False)
        return values


def rope_inverse_frequencies(cfg: LlamaConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama-3.1's frequency-dependent rescaling when configured."""
    dim = cfg.head_dim
    # fp32 as transformers computes it, so positions far into the context rotate identically.
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    scaling = cfg.rope_scaling
    if not scaling or scaling["rope_type"] == "default":
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    # Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept, and the band
    # between them interpolated smoothly.
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return scaled
