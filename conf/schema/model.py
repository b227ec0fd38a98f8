"""The `model` config group: which Llama, from a checkpoint or by its architecture for random init."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from conf.errors import ConfigError

MISSING = "???"     # omegaconf.MISSING, spelled out so this module needs no omegaconf


@dataclass
class ModelConfig:
    name: str = MISSING
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
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # The rope and context, in Hugging Face's keys; with `path` they override the checkpoint's (context
    # extension: docs/LONG_CONTEXT.md). None: the checkpoint's, or for random init 500000.0, 8192 and none.
    # rope_scaling as in config.json, e.g. {rope_type: yarn, factor: 8.0, original_max_position_embeddings: 8192}
    # (typed Any: OmegaConf cannot set a dict from the command line on a null Dict-typed setting).
    rope_theta: Optional[float] = None
    max_position_embeddings: Optional[int] = None
    rope_scaling: Any = None


# Every architecture setting, in the order config.json has them.
ARCHITECTURE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                     "rope_scaling", "tie_word_embeddings")
GROUP_DIR = Path(__file__).resolve().parents[1] / "model"


def group_values(name: str) -> dict:
    """The settings conf/model/<name>.yaml gives the model group ({} for a name no group file has)."""
    import yaml
    file = GROUP_DIR / f"{name}.yaml"
    values = (yaml.safe_load(file.read_text()) or {}) if file.is_file() else {}
    nested = values.get("model")           # a file in the global package sets model.* under `model:`
    return nested if isinstance(nested, dict) else values


def given_architecture(model_cfg: dict) -> dict:
    """The architecture settings of `model_cfg` (a plain dict) that were given rather than left to the model
    group or the schema: with model.path, these must agree with the checkpoint (or override its rope)."""
    group, defaults = group_values(model_cfg["name"]), ModelConfig()
    return {key: model_cfg[key] for key in ARCHITECTURE_KEYS
            if model_cfg[key] not in (None, MISSING) and model_cfg[key] != group.get(key, getattr(defaults, key))}


def check_model(model_cfg) -> None:
    if model_cfg.path is not None and not Path(model_cfg.path).expanduser().is_dir():
        raise ConfigError(f"model.path={model_cfg.path!r} is not a directory: give a local Hugging Face "
                          f"checkpoint directory, or drop model.path for random init")
    if model_cfg.num_attention_heads % model_cfg.num_key_value_heads:
        raise ConfigError(f"model.num_attention_heads={model_cfg.num_attention_heads} must be a multiple of "
                          f"model.num_key_value_heads={model_cfg.num_key_value_heads}")
