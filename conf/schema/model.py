"""The `model` config group: which Llama, from a checkpoint or by its architecture for random init."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from conf.errors import ConfigError

MISSING = "???"     # omegaconf.MISSING, spelled out so this module needs no omegaconf


@dataclass
class ModelConfig:
    name: str = MISSING
    # Local Hugging Face checkpoint directory; None trains from random init (benchmarks, demos).
    path: Optional[str] = None
    # Architecture, used for random init; with `path` set, the checkpoint's config.json decides.
    vocab_size: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: Optional[int] = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    tie_word_embeddings: bool = False


def check_model(model_cfg) -> None:
    if model_cfg.path is not None and not Path(model_cfg.path).expanduser().is_dir():
        raise ConfigError(f"model.path={model_cfg.path!r} is not a directory: give a local Hugging Face "
                          f"checkpoint directory, or drop model.path for random init")
    if model_cfg.num_attention_heads % model_cfg.num_key_value_heads:
        raise ConfigError(f"model.num_attention_heads={model_cfg.num_attention_heads} must be a multiple of "
                          f"model.num_key_value_heads={model_cfg.num_key_value_heads}")
