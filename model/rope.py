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
import math

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
    """ValueError naming what `cfg`'s rope lacks or has wrong: a value outside the domain transformers' rope
    validation states (rope_value_problem), or what computing its frequencies once finds."""
    if not (is_number(cfg.rope_theta) and cfg.rope_theta > 0):
        raise ValueError(f"rope_theta={cfg.rope_theta} must be a positive number")
    if cfg.rope_type == "default":
        return
    problem = rope_value_problem(cfg)
    if problem:
        raise ValueError(f"rope_scaling {cfg.rope_scaling} is outside a {cfg.rope_type} rope's domain: {problem}")
    try:
        _, attention_factor = rope_frequencies(cfg, cfg.max_position_embeddings, "cpu")
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        problem = error.args[0] if isinstance(error, KeyError) and error.args else error   # not repr'd
        raise ValueError(f"rope_scaling {cfg.rope_scaling} does not define a {cfg.rope_type} rope: "
                         f"{problem}") from None
    if not (math.isfinite(attention_factor) and attention_factor > 0):      # yarn's, from mscale / mscale_all_dim
        raise ValueError(f"rope_scaling {cfg.rope_scaling} is outside a {cfg.rope_type} rope's domain: "
                         f"mscale={cfg.rope_scaling.get('mscale')} and mscale_all_dim="
                         f"{cfg.rope_scaling.get('mscale_all_dim')} give an attention factor of "
                         f"{attention_factor:.3f}, which must be positive")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def rope_value_problem(cfg: DecoderConfig) -> str | None:
    """The first rope_scaling value outside the domain transformers' rope validation states (it only warns, and
    the rope then trains: a factor of 0 made every step NaN, one of -2 trained): a factor below 1, an attention
    factor or beta not positive, beta_fast not above beta_slow (yarn), factor lists not of head_dim / 2 positive
    numbers (longrope), low_freq_factor not below high_freq_factor (llama3), an original context that is not a
    positive integer. None when every value given is in its domain (missing ones the computation names)."""
    scaling = cfg.rope_scaling
    factor = scaling.get("factor")
    if factor is not None and not (is_number(factor) and factor >= 1):
        return f"factor={factor} must be a number >= 1 (how many times the original context: 4 for 4x)"
    original = scaling.get("original_max_position_embeddings")
    if original is not None and not (isinstance(original, int) and original > 0):
        return f"original_max_position_embeddings={original} must be a positive integer"
    positive = ["attention_factor"] + ["beta_fast", "beta_slow"] * (cfg.rope_type == "yarn")
    for name in positive + ["low_freq_factor", "high_freq_factor"] * (cfg.rope_type == "llama3"):
        value = scaling.get(name)
        if value is not None and not (is_number(value) and value > 0):
            return f"{name}={value} must be a positive number"
    if cfg.rope_type == "yarn":
        # transformers' defaults, as its yarn computation takes them
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
        if fast <= slow:
            given = lambda name, value: f"{name}={value}" + " (its default)" * (scaling.get(name) is None)  # noqa: E731
            return f"{given('beta_fast', fast)} must be greater than {given('beta_slow', slow)}"
    if cfg.rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            values = scaling.get(name)
            if values is not None and not (isinstance(values, (list, tuple)) and len(values) == cfg.head_dim // 2
                                           and all(is_number(value) and value > 0 for value in values)):
                return f"{name} must be a list of {cfg.head_dim // 2} positive numbers (head_dim / 2), got {values}"
    if cfg.rope_type == "llama3":
        low, high = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
        if low is not None and high is not None and not low < high:
            return f"low_freq_factor={low} must be below high_freq_factor={high}"
    return None
