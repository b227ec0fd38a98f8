"""Rotary position embedding tables for every rope type transformers implements for the families built here
(default, linear, dynamic, yarn, longrope, llama3).

The inverse frequencies and the attention factor come from transformers' own rope initialisation
(`modeling_rope_utils.ROPE_INIT_FUNCTIONS`), so a scaled rope means here what it means in transformers; the
attention factor (yarn, longrope) multiplies cos and sin, as in transformers. The tables are built once per
forward and the fused RoPE kernel consumes them, so only the tables depend on the rope type.

Dynamic NTK and LongRoPE depend on the sequence length: transformers recomputes them per forward from the
longest position; here they are computed at a fixed `length` (the trainer's seq_len), so every step of a
run trains one rope (docs/LONG_CONTEXT.md).
"""
from __future__ import annotations

import functools
import json

import torch

from model.config import DecoderConfig


# What transformers' rope initialisation reads of a config (the same for every family built here).
ROPE_INPUTS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
               "rope_theta", "rope_scaling")


@functools.lru_cache(maxsize=8)
def _hf_config(values_json: str):
    from transformers import LlamaConfig as HFLlamaConfig
    return HFLlamaConfig(**json.loads(values_json))


def hf_config(cfg: DecoderConfig):
    """transformers' LlamaConfig of `cfg`'s rope (cached: the tables are built every forward)."""
    return _hf_config(json.dumps({key: getattr(cfg, key) for key in ROPE_INPUTS}, sort_keys=True))


def default_frequencies(cfg: DecoderConfig, device: torch.device | str | None) -> torch.Tensor:
    """Unscaled RoPE: the formula of transformers' LlamaRotaryEmbedding.compute_default_rope_parameters (a
    method whose signature changed between transformers 5.17 and 5.24, hence not called), computed on
    `device` in fp32 so that positions far into the context rotate as in transformers."""
    dim = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def rope_frequencies(cfg: DecoderConfig, length: int | None = None,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] fp32, attention factor) of `cfg`'s rope for sequences of `length`
    tokens (read by dynamic and longrope only)."""
    if cfg.rope_type == "default":
        return default_frequencies(cfg, device), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if cfg.rope_type == "dynamic" and length is not None:
        # As transformers' forward hands it over: a tensor, so the rescaled base is computed in fp32 as there.
        length = torch.tensor(length)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf_config(cfg), device, seq_len=length)
    return inv_freq.to(device=device, dtype=torch.float32), float(attention_factor)


def rope_tables(cfg: DecoderConfig, position_ids: torch.Tensor, dtype: torch.dtype,
                length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, S, 1, head_dim] of `position_ids` [B, S], the attention factor applied, as the fused
    RoPE kernel takes them. `length`: the sequence length dynamic and longrope scale for (default: S)."""
    inv_freq, attention_factor = rope_frequencies(cfg, length or position_ids.shape[-1], position_ids.device)
    angles = position_ids.float()[..., None] * inv_freq                    # [B, S, D/2]
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]          # [B, S, 1, D]
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def check_rope(cfg: DecoderConfig) -> None:
    """ValueError naming what `cfg.rope_scaling` lacks or has wrong, by computing its frequencies once."""
    if cfg.rope_type == "default":
        return
    try:
        rope_frequencies(cfg, cfg.max_position_embeddings, "cpu")
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        problem = error.args[0] if isinstance(error, KeyError) and error.args else error   # not repr'd
        raise ValueError(f"rope_scaling {cfg.rope_scaling} does not define a {cfg.rope_type} rope: "
                         f"{problem}") from None
