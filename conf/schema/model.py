"""The `model` config group: which model (family, shape), from a checkpoint or by its architecture."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from conf.errors import ConfigError

MISSING = "???"     # omegaconf.MISSING, spelled out so this module needs no omegaconf


@dataclass
class ModelConfig:
    name: str = MISSING
    # The model family (model/families/: llama, qwen2, qwen3, mistral; checked by trainer.architecture, as conf
    # imports no model code; "llama" is model.families.DEFAULT_FAMILY), which the model group names. With `path`
    # the checkpoint's config.json decides, like the shape below.
    family: str = "llama"
    # Local Hugging Face checkpoint directory; None trains from random init (benchmarks, demos).
    path: Optional[str] = None
    # Architecture, used for random init (the model group sets it). With `path` the checkpoint's config.json
    # decides: a key given that differs from it is an error, but for the three below.
    vocab_size: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: Optional[int] = None
    rms_norm_eps: Optional[float] = None      # None: the family's (Llama 1e-5, Qwen3 1e-6)
    tie_word_embeddings: bool = False
    # The rope and context, in Hugging Face's keys; with `path` they override the checkpoint's (context
    # extension: docs/LONG_CONTEXT.md). None: the checkpoint's, or for random init 500000.0, 8192 and none.
    # rope_scaling as in config.json, e.g. {rope_type: yarn, factor: 8.0, original_max_position_embeddings: 8192}
    # (typed Any: OmegaConf cannot set a dict from the command line on a null Dict-typed setting).
    rope_theta: Optional[float] = None
    max_position_embeddings: Optional[int] = None
    rope_scaling: Any = None


# Every architecture setting, the family first, then in the order config.json has them.
ARCHITECTURE_KEYS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings")
# The model group files (conf/model/<name>.yaml).
GROUP_DIR = Path(__file__).resolve().parents[1] / "model"


def check_model(model_cfg) -> None:
    if model_cfg.path is not None and not Path(model_cfg.path).expanduser().is_dir():
        raise ConfigError(f"model.path={model_cfg.path!r} is not a directory: give a local Hugging Face "
                          f"checkpoint directory, or drop model.path for random init")
    if model_cfg.num_attention_heads % model_cfg.num_key_value_heads:
        raise ConfigError(f"model.num_attention_heads={model_cfg.num_attention_heads} must be a multiple of "
                          f"model.num_key_value_heads={model_cfg.num_key_value_heads}")
