"""Hugging Face model directories (config.json + safetensors, with a tokenizer and generation_config.json
beside them): loading a local checkpoint of any model family built here (model/families/), and writing our
model as one that transformers loads (the export)."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.config import ORIGINAL_CONTEXT_TYPES, DecoderConfig
from model.families import DEFAULT_FAMILY
from model.rope import check_rope
from storage.atomic import atomic_directory

# The single-file weights of a model directory; training checkpoints of full fine-tuning use it too.
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# config.json entries that are not architecture: generation and the tokenizer depend on them.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Buffers some older checkpoints carry; we recompute them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The architecture keys a run may change on top of a checkpoint (context extension): the rest is its weights'.
ROPE_OVERRIDE_KEYS = ("rope_theta", "rope_scaling", "max_position_embeddings")


class HFCheckpointError(ValueError):
    """A Hugging Face model directory that is missing, incomplete or does not match the model."""


def read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise HFCheckpointError(f"{file} is not valid JSON: {error}") from error


def read_config(path: Path, overrides: dict | None = None) -> DecoderConfig:
    """The architecture of the checkpoint at `path`, with `overrides` (ROPE_OVERRIDE_KEYS, None: the
    checkpoint's) applied."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HFCheckpointError(f"{path} has no config.json: expected a Hugging Face model directory "
                              f"(config.json and *.safetensors)")
    values = read_json(config_file)
    if "model_type" not in values and "architectures" not in values:
        values["family"] = DEFAULT_FAMILY           # files written before transformers named either
    try:
        return with_overrides(DecoderConfig.from_dict(values), overrides or {})
    except ValueError as error:
        raise HFCheckpointError(f"{config_file}: {error}") from None


def with_overrides(cfg: DecoderConfig, overrides: dict) -> DecoderConfig:
    """`cfg` with the rope keys of `overrides` that are not None, checked (check_rope). A new scaling without
    original_max_position_embeddings extends `cfg`'s context (transformers would take the new
    max_position_embeddings instead)."""
    unknown = sorted(set(overrides) - set(ROPE_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"only {', '.join(ROPE_OVERRIDE_KEYS)} can change a checkpoint's architecture, not "
                         f"{', '.join(unknown)}")
    changes = {key: value for key, value in overrides.items() if value is not None}
    scaling = changes.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) in ORIGINAL_CONTEXT_TYPES:
        changes["rope_scaling"] = {**scaling, "original_max_position_embeddings":
                                   scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)}
    cfg = dataclasses.replace(cfg, **changes)
    check_rope(cfg)
    return cfg


def token_ids(path: Path) -> dict:
    """The bos/eos/pad token ids that <path>/config.json sets."""
    values = read_json(path / "config.json")
    return {key: values[key] for key in TOKEN_ID_KEYS if key in values}


def weight_files(path: Path) -> list[Path]:
    """The safetensors files named by the index, or every *.safetensors file when there is no index."""
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(read_json(index)["weight_map"].values()))
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise HFCheckpointError(f"{index} names shard files that are missing from {path}: {missing}")
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not "
                              f"supported: convert them with save_pretrained(safe_serialization=True))")
    return files


def read_shard(file: Path, expected: dict, tied: bool, dtype: torch.dtype,
               device: torch.device | str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, each checked against the model's name and shape."""
    state = {}
    with safe_open(str(file), framework="pt", device=str(device)) as shard:
        for name in shard.keys():
            if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            if name not in expected:
                raise HFCheckpointError(f"{file} holds tensor {name!r}, which the model its config.json describes "
                                        f"does not have")
            tensor = shard.get_tensor(name)
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise HFCheckpointError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                        f"config.json implies {tuple(expected[name].shape)}")
            state[name] = tensor.to(dtype)
    return state


def load_pretrained(cls, path: str | Path, dtype: torch.dtype, device: torch.device | str,
                    overrides: dict | None = None):
    """A `cls` (our CausalLM) with the weights at `path` and its architecture (read_config)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise HFCheckpointError(f"model path {str(path)!r} is not a directory: give model.path=<local HF "
                              f"checkpoint directory>")
    cfg = read_config(path, overrides)
    with torch.device("meta"):
        model = cls(cfg)
    expected = dict(model.state_dict(keep_vars=True))
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            state.update(read_shard(file, expected, cfg.tie_word_embeddings, dtype, device))
        except SafetensorError as error:
            raise HFCheckpointError(f"{file} is truncated or damaged ({error}): copy or download this file "
                                    f"again") from error
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise HFCheckpointError(f"checkpoint {path} is missing {len(missing)} tensors: {shown}")
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    model.tie_weights()
    return model


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is wrapped by peft (its own weights are then the adapters, not the base)."""
    return hasattr(model, "peft_config")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Our CausalLM under any wrapper (peft's PeftModel -> LoraModel -> CausalLM)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our model's weights under Hugging Face names, without a tied head (safetensors stores each tensor
    once). For a peft model: the frozen base, without the adapters."""
    lora = is_lora(model)
    lm = unwrap_model(model)
    weights = {}
    for name, tensor in lm.state_dict().items():
        if lora and "lora_" in name:
            continue
        weights[name.replace(".base_layer.", ".")] = tensor.detach().contiguous()
    if lm.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def save_weights(weights: dict[str, torch.Tensor], directory: Path) -> None:
    """`weights` as <directory>/model.safetensors, in the format transformers reads."""
    save_file(weights, directory / WEIGHTS_FILE, metadata={"format": "pt"})


def save_linked_model(source: Path, config: dict, directory: Path) -> Path:
    """A Hugging Face model directory holding `source`'s files (weights, tokenizer, generation config) as
    links, nothing copied, beside a config.json that is `source`'s updated by `config` (its token ids and
    dtype kept): the same weights under another architecture's rope. Written atomically."""
    values = read_json(source / "config.json")
    # `config` gives rope_theta and rope_scaling; transformers 5 would read a stale rope_parameters first.
    values.pop("rope_parameters", None)
    values.update(config)
    with atomic_directory(directory) as temp:
        for file in sorted(source.resolve().iterdir()):
            if file.is_file() and file.name != "config.json":
                (temp / file.name).symlink_to(file)
        (temp / "config.json").write_text(json.dumps(values, indent=1))
    return directory


def save_hf_model(weights: dict[str, torch.Tensor], config: dict, directory: Path,
                  companions: list[Path] = ()) -> Path:
    """A Hugging Face model directory (config.json + model.safetensors, and copies of `companions`: the
    tokenizer and generation config of the model it came from), written atomically."""
    with atomic_directory(directory) as temp:
        save_weights(weights, temp)
        (temp / "config.json").write_text(json.dumps(config, indent=1))
        for file in companions:
            shutil.copy2(file, temp / file.name)
    return directory
