"""Loading a local Hugging Face Llama checkpoint directory (config.json + safetensors shards)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from model.config import LlamaConfig

INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints carry; we recompute them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or does not match the model."""


def read_config(path: Path) -> LlamaConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json: expected a Hugging Face model directory "
                              f"(config.json and *.safetensors)")
    try:
        values = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_file} is not valid JSON: {error}") from error
    if values.get("model_type", "llama") != "llama":
        raise CheckpointError(f"{config_file} describes model_type={values['model_type']!r}; only 'llama' loads")
    return LlamaConfig.from_dict(values)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files named by the index, or every *.safetensors file when there is no index."""
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing from {path}: {missing}")
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not "
                              f"supported: convert them with save_pretrained(safe_serialization=True))")
    return files


def load_pretrained(cls, path: str | Path, dtype: torch.dtype, device: torch.device | str):
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a directory: give model.path=<local HF "
                              f"checkpoint directory>")
    cfg = read_config(path)
    with torch.device("meta"):
        model = cls(cfg)
    expected = dict(model.state_dict(keep_vars=True))
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device=str(device)) as shard:
            for name in shard.keys():
                if name.endswith(IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if name not in expected:
                    raise CheckpointError(f"{file} holds tensor {name!r}, which a Llama model does not have")
                tensor = shard.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                          f"config.json implies {tuple(expected[name].shape)}")
                state[name] = tensor.to(dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path} is missing {len(missing)} tensors: {shown}")
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    model.tie_weights()
    return model
