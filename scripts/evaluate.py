"""Evaluate a model as training does (trainer/evaluate.py): held-out loss and perplexity, loss by token
position and passkey retrieval, on a GPU or the CPU.

    .venv/bin/python scripts/evaluate.py <run dir>/checkpoints/step-<N> --out <dir> [override ...]
    .venv/bin/python scripts/evaluate.py <exported or Hugging Face model dir> --out <dir> [override ...]
    .venv/bin/python scripts/evaluate.py --out <dir> model=llama3_1_8b model.path=/models/Llama-3.1-8B seq_len=65536
    .venv/bin/python scripts/evaluate.py --out <dir> model=llama3_8b seq_len=131072 eval.passkey.lengths=0 --repeat 2

A training checkpoint is evaluated with its run's config (seq_len, batch_size, data, eval.*; LoRA adapters
merged into their base, as scripts/export.py does); a model directory (an export, or any local Hugging Face
CausalLM: model.path) with the config's defaults and model.path=<dir>; with neither, the model group's random
init (for timing). Overrides are the trainer's Hydra settings on top: seq_len, device=cpu|cuda, eval.sequences,
eval.path / eval.fraction (held-out files; data=recall needs none), eval.passkey.* (the passkey probe needs
model.path's tokenizer; eval=thorough, with a model directory, for a denser heatmap), and the model's RoPE
settings.

Writes <out>/evaluation.json (every eval/ figure, the time of each repetition, the model and seq_len),
<out>/loss_by_position.png and, with a passkey probe, <out>/passkey.png. --repeat N evaluates N times (on a
GPU the first also compiles and tunes kernels): each time is in the JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import kernels
from conf.schema import JobConfig, register_configs
from conf.schema.job import resolve_device
from conf.validate import ConfigError, check_known_keys, validate
from data import DataError
from model import CausalLM
from model.hf_checkpoint import HFCheckpointError
from offload.plan import mlp_tiles
from offload.policy import apply_memory_policy
from scripts.export import ExportError, full_model, lora_base_dir, merged_lora
from scripts.report import loss_by_position_figure, passkey_cells, passkey_figure, position_curve
from trainer.architecture import (given_model_keys, model_architecture, record_architecture,
                                  rope_overrides, saved_config)
from trainer.checkpoint.format import ADAPTER_DIR, CONFIG_FILE, CheckpointError, content_problem
from trainer.evaluate import build_evaluator, check_passkey

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def is_checkpoint(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / "COMPLETE").is_file()


def job_config(source: Path | None, overrides: list[str]):
    """The config to evaluate with: a checkpoint's run config, or the defaults (with model.path=<source> for a
    model directory), the overrides on top, the architecture recorded (record_architecture: a setting the
    command line gives is never taken for the model group's); evaluation on (eval.at_start), whatever the run had."""
    register_configs()
    try:
        if source is not None and is_checkpoint(source):
            saved = saved_config((source / CONFIG_FILE).read_text())
            given = OmegaConf.from_dotlist(overrides)
            check_known_keys(given)
            cfg = OmegaConf.merge(OmegaConf.structured(JobConfig), saved, given)
        else:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                path = [f"model.path={source}"] if source is not None else []
                cfg = compose("config", overrides=path + overrides)
            record_architecture(cfg, given_keys=given_model_keys(overrides))
    except (HydraException, OmegaConfBaseException) as error:     # a misspelt key, a value of the wrong type
        reasons = [str(reason).splitlines()[0] for reason in (error, error.__cause__) if reason]
        raise ConfigError(f"the overrides {' '.join(overrides)} do not apply: {': '.join(reasons)}") from None
    cfg.eval.at_start = True
    return cfg


def checkpoint_weights(checkpoint: Path, cfg) -> dict[str, torch.Tensor]:
    """A training checkpoint's weights, LoRA merged into its base (scripts/export.py)."""
    problem = content_problem(checkpoint)
    if problem:
        raise ExportError(f"cannot evaluate {checkpoint}: {problem}")
    if (checkpoint / ADAPTER_DIR).is_dir():
        return merged_lora(checkpoint, lora_base_dir(checkpoint, cfg), cfg)[0]
    return full_model(checkpoint, cfg)[0]


def load_weights(model: CausalLM, weights: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Load a checkpoint's weights into `model`, every one of its tensors and nothing else (the output layer
    may be left out when it is tied to the embeddings); ExportError naming the first mismatch otherwise."""
    result = model.load_state_dict(weights, strict=False)
    tied = model.config.tie_word_embeddings
    missing = [name for name in result.missing_keys if not (tied and name == "lm_head.weight")]
    mismatches = [f"{len(names)} {kind} (first: {names[0]})"
                  for kind, names in (("missing", missing), ("unexpected", result.unexpected_keys)) if names]
    if mismatches:
        raise ExportError(f"cannot evaluate {checkpoint}: its weights do not fit the model of its config: "
                          f"{', '.join(mismatches)}")
    model.tie_weights()


def load_model(source: Path | None, cfg, device: torch.device) -> CausalLM:
    """The model on `device` (bf16 on a GPU, fp32 on the CPU) with the architecture training builds
    (trainer.architecture.model_architecture: model.path's or the model group's, the rope settings applied), its RoPE
    computed for seq_len and its MLP tiled as training tiles it."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arch = model_architecture(cfg)
    if source is not None and is_checkpoint(source):
        model = CausalLM.from_config(arch)
        load_weights(model, checkpoint_weights(source, cfg), source)
        model = model.to(device=device, dtype=dtype)
    elif cfg.model.path:
        model = CausalLM.from_pretrained(cfg.model.path, dtype=dtype, device=device, overrides=rope_overrides(arch))
    else:
        model = CausalLM.from_config(arch, dtype=dtype, device=device)
    model.train_rope_at(cfg.seq_len)
    apply_memory_policy(model, None, mlp_tiles(cfg.seq_len * cfg.batch_size, cfg.memory), device)
    return model


def write_outputs(out: Path, figures: dict, times: list[float], cfg, source: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = {"source": str(source) if source else f"random init {cfg.model.name}", "seq_len": cfg.seq_len,
               "batch_size": cfg.batch_size, "device": str(resolve_device(cfg.device)), "times_s": times, **figures}
    (out / "evaluation.json").write_text(json.dumps(summary, indent=1))
    title = f"{summary['source']} at seq_len {cfg.seq_len}"
    drawings = {"loss_by_position.png": loss_by_position_figure(f"Held-out loss by position: {title}",
                                                                {"evaluation": position_curve(figures)})}
    if passkey_cells(figures)[0]:
        drawings["passkey.png"] = passkey_figure(f"Passkey retrieval: {title}", {"evaluation": passkey_cells(figures)})
    for name, drawing in drawings.items():
        drawing.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(drawing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arguments", nargs="*", help="[checkpoint or model directory] [Hydra override ...]")
    parser.add_argument("--out", type=Path, required=True, help="directory for evaluation.json and the PNGs")
    parser.add_argument("--repeat", type=int, default=1, help="evaluations to run and time (default 1)")
    args = parser.parse_intermixed_args()
    overrides = [argument for argument in args.arguments if "=" in argument]
    sources = [Path(argument).expanduser() for argument in args.arguments if "=" not in argument]
    if len(sources) > 1:
        sys.exit(f"give one checkpoint or model directory, got {len(sources)}: {', '.join(map(str, sources))}")
    source = sources[0] if sources else None
    try:
        cfg = job_config(source, overrides)
        validate(cfg)
        check_passkey(cfg)
        device = resolve_device(cfg.device)
        kernels.set_backend(cfg.kernels)
        model = load_model(source, cfg, device)
        evaluator = build_evaluator(cfg, model, device)
    except (ConfigError, DataError, CheckpointError, HFCheckpointError, ExportError, OSError) as error:
        sys.exit(f"evaluation failed: {error}")
    times, figures = [], {}
    for _ in range(args.repeat):
        started = time.perf_counter()
        figures = evaluator.evaluate(with_passkey=True)
        times.append(time.perf_counter() - started)
        print(f"evaluated in {times[-1]:.2f} s: loss {figures['eval/loss']:.4f}"
              + (f", passkey {figures['eval/passkey/accuracy']:.2f}" if "eval/passkey/accuracy" in figures else ""),
              flush=True)
    write_outputs(args.out, figures, times, cfg, source)
    print(f"wrote {args.out / 'evaluation.json'} and the PNGs beside it")


if __name__ == "__main__":
    main()
