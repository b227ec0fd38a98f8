"""Export a training checkpoint as a merged Hugging Face model directory.

    .venv/bin/python scripts/export.py <run dir>/checkpoints/step-<N> <out dir> [--dtype auto|float32|bfloat16]
        [--tokenizer <dir>]

LoRA checkpoints are merged into their base: model.path from the checkpoint's config, or for a random-init
base the <run dir>/base_model/ the trainer kept. Full fine-tuning checkpoints are written as they are. The
tokenizer files, generation_config.json and bos/eos/pad token ids of the model it came from (model.path)
are carried over, so the output loads with transformers.AutoModelForCausalLM.from_pretrained(<out dir>),
AutoTokenizer and pipeline("text-generation", model=<out dir>). A run without model.path (random init) has
no tokenizer: --tokenizer <dir> copies one from a directory holding a saved tokenizer, and without it the
export says that none was written. --dtype auto keeps the dtype the weights are stored in (the base's, for
LoRA).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from conf.errors import ConfigError
from data.tokenize import TOKENIZER_FILES, DataError, check_vocabulary, load_tokenizer, tokenizer_files
from model import CausalLM
from model.hf_checkpoint import WEIGHTS_FILE, HFCheckpointError, full_weights, token_ids, weight_files
from trainer.architecture import model_architecture, rope_overrides, saved_config
from trainer.build import BASE_MODEL_DIR
from trainer.checkpoint.disk_space import save_hf_model_if_room
from trainer.checkpoint.format import (ADAPTER_DIR, CHECKPOINTS_DIR, CONFIG_FILE, CheckpointError,
                                       complete_checkpoints, content_problem, load_adapter)
from trainer.checkpoint.sharded_state import STATE_DIR, sharded_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
GENERATION_CONFIG_FILE = "generation_config.json"


class ExportError(RuntimeError):
    """A checkpoint that cannot be exported; the message says why and what to do."""


def stored_dtype(weights_file: Path) -> torch.dtype:
    with safe_open(str(weights_file), framework="pt") as file:
        return SAFETENSORS_DTYPES[file.get_slice(next(iter(file.keys()))).get_dtype()]


def companion_files(model_dir: Path) -> list[Path]:
    """What a model directory holds besides config and weights that users of the model need: the tokenizer's
    files and generation_config.json."""
    generation = model_dir / GENERATION_CONFIG_FILE
    return tokenizer_files(model_dir) + ([generation] if generation.is_file() else [])


def lora_base_dir(checkpoint: Path, cfg) -> Path:
    """The run's base_model/ (a random init, or model.path under a changed rope), else model.path (merged_lora
    gives it the run's rope)."""
    base = checkpoint.parent.parent / BASE_MODEL_DIR
    if cfg.model.path and not base.is_dir():
        return Path(cfg.model.path).expanduser()
    if not base.is_dir():
        raise ExportError(f"{checkpoint} is a LoRA adapter on a random-init base, and the run kept no copy of "
                          f"that base ({base} is missing; checkpoint.save_random_base was false), so there is "
                          f"nothing to merge into. Re-train with checkpoint.save_random_base=true, or with "
                          f"model.path=<a saved base>.")
    return base


def merged_lora(checkpoint: Path, base_dir: Path, cfg) -> tuple[dict[str, torch.Tensor], dict, torch.dtype]:
    """(weights, config.json, stored dtype) of the base with the adapter merged in, computed in fp32. The base
    is loaded with the run's rope (model_architecture), so that an adapter trained on a changed rope is never
    merged onto model.path's old one, whether or not the run's base_model/ is there."""
    base = CausalLM.from_pretrained(str(base_dir), dtype=torch.float32, device="cpu",
                                 overrides=rope_overrides(model_architecture(cfg)))
    merged = load_adapter(base, checkpoint / ADAPTER_DIR).merge_and_unload()
    return full_weights(merged), merged.config.to_hf_dict(), stored_dtype(weight_files(base_dir)[0])


def full_model(checkpoint: Path, cfg) -> tuple[dict[str, torch.Tensor], dict, torch.dtype]:
    from safetensors.torch import load_file
    config = model_architecture(cfg)     # the run's recorded architecture, as training resolved it
    if (checkpoint / STATE_DIR).is_dir():     # saved by a run over several processes
        weights = sharded_weights(checkpoint / STATE_DIR)
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights, config.to_hf_dict(), next(iter(weights.values())).dtype
    weights = load_file(checkpoint / WEIGHTS_FILE)
    return weights, config.to_hf_dict(), stored_dtype(checkpoint / WEIGHTS_FILE)


def tokenizer_source(tokenizer: Path | None) -> list[Path]:
    """The tokenizer files of --tokenizer <dir> (none without it); ExportError when it holds no tokenizer."""
    if tokenizer is None:
        return []
    files = tokenizer_files(tokenizer) if tokenizer.is_dir() else []
    if not any(file.name in TOKENIZER_FILES for file in files):
        raise ExportError(f"--tokenizer {tokenizer} holds no saved tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                          f"give a directory written by AutoTokenizer.save_pretrained")
    return files


def export(checkpoint: Path, out_dir: Path, dtype: str = "auto", tokenizer: Path | None = None) -> Path:
    """Write `checkpoint` as a Hugging Face model into the new directory `out_dir`; `tokenizer`: a directory
    whose saved tokenizer replaces model.path's (the only one a random-init run can have)."""
    checkpoint = Path(checkpoint).expanduser()
    if (checkpoint / CHECKPOINTS_DIR).is_dir():     # a run directory: which of its checkpoints to give
        complete = complete_checkpoints(checkpoint / CHECKPOINTS_DIR)
        raise ExportError(f"{checkpoint} is a run directory, not a checkpoint: give one of its checkpoints, "
                          + (f"the newest being {complete[-1]}" if complete else "once it holds a complete one "
                             "(it has none yet)"))
    problem = content_problem(checkpoint) if checkpoint.is_dir() else "it is not a directory"
    if problem:
        raise ExportError(f"cannot export {checkpoint}: {problem}. Give a complete "
                          f"<run dir>/checkpoints/step-<N> directory.")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportError(f"{out_dir} exists and is not empty: give a new output directory (nothing there was "
                          f"changed)")
    if dtype != "auto" and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    tokenizer_copy = tokenizer_source(tokenizer)
    cfg = saved_config((checkpoint / CONFIG_FILE).read_text())
    lora = (checkpoint / ADAPTER_DIR).is_dir()
    # The Hugging Face directory the model came from: its tokenizer, generation config and token ids go along.
    source = lora_base_dir(checkpoint, cfg) if lora else cfg.model.path and Path(cfg.model.path).expanduser()
    weights, config, stored = merged_lora(checkpoint, source, cfg) if lora else full_model(checkpoint, cfg)
    if tokenizer_copy:
        check_vocabulary(load_tokenizer(str(tokenizer)), config["vocab_size"], str(tokenizer), "--tokenizer")
    target = stored if dtype == "auto" else DTYPES[dtype]
    config |= token_ids(source) if source else {}
    config["torch_dtype"] = str(target).removeprefix("torch.")
    companions = companion_files(source) if source else []
    if tokenizer_copy:
        companions = [file for file in companions if file not in tokenizer_files(source)] + tokenizer_copy
    return save_hf_model_if_room({name: tensor.to(target) for name, tensor in weights.items()}, config, out_dir,
                                 companions)


def why_no_tokenizer(checkpoint: Path) -> str:
    """Why an export of `checkpoint` carried no tokenizer over: its run had no model.path, or that has none."""
    model_path = yaml.safe_load((Path(checkpoint).expanduser() / CONFIG_FILE).read_text())["model"]["path"]
    if not model_path:
        return "the run had no model.path (random init)"
    return f"the run's model.path={model_path} holds no tokenizer files"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="<run dir>/checkpoints/step-<N>")
    parser.add_argument("out_dir", type=Path, help="new directory for the Hugging Face model")
    parser.add_argument("--dtype", default="auto", help="auto (as stored), float32, bfloat16 or float16")
    parser.add_argument("--tokenizer", type=Path, help="directory of a saved tokenizer to write with the model "
                                                       "(default: model.path's)")
    args = parser.parse_args()
    try:
        out = export(args.checkpoint, args.out_dir, args.dtype, args.tokenizer)
    except (ExportError, CheckpointError, ConfigError, DataError, HFCheckpointError, OSError) as error:
        sys.exit(f"export failed: {error}")
    print(f"exported {args.checkpoint} to {out} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    if not tokenizer_files(out):
        print(f"no tokenizer written: {why_no_tokenizer(args.checkpoint)}, so pipeline() and AutoTokenizer cannot "
              f"load {out}; add one with --tokenizer <dir of a saved tokenizer> (into a new out dir)")



if __name__ == "__main__":
    main()
