"""The recall job of scripts/recall_curve.py: the task's recipe at each length, the warm start's length and
steps, and the two runs' train.py commands of each comparison (--compare): the fast path against the
reference (its memory settings), and FP8 against bf16 (LoRA from the warm start)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from kernels.attention import choose_route

REPO = Path(__file__).resolve().parents[2]

# What each --compare runs twice, by its name (the default PNG docs/<name>.png and run root outputs/<name>/):
# paths: full training on the fast path and on the reference path; fp8: LoRA with the frozen base in bf16 and
# in FP8 (issue 41's quality gate), from a warm start that already recalls at 4k.
COMPARISONS = {"paths": "recall_curve", "fp8": "fp8_quality"}
DEFAULT_STEPS = {"paths": 1200, "fp8": 1000}
COMMON = ["logger.wandb.mode=disabled", "logger.progress_bar=false", "checkpoint.every_minutes=0",
          "checkpoint.save_random_base=false", "resume=false"]
# The recall task at long context (from LONG_RECALL_FROM tokens): LONG_RECALL_PAIRS facts, each recurring once
# per RECALL_SPACING tokens, at most 4,096 supervised tokens per sequence (trainer.step logs accuracy up to
# there), and two sequences per step (gradient accumulation: each micro-batch stays under that limit). Fewer
# recurrences or one sequence per step learned nothing within 300 steps with the tiny model at 2k tokens; what
# the recipe learns at 32k, and in how many steps: docs/PERFORMANCE.md, "The fast path trains".
LONG_RECALL_FROM = 4096
# From WARM_START_FROM tokens both runs start from a model trained WARM_START_STEPS[compare] steps at 4k
# (--warm-start-*): from random init, learning the task slows sharply past 8k tokens (docs/PERFORMANCE.md, "The
# fast path trains"). paths: 150 steps at 4k leave recall_100m naming some value of its sequence but not the
# key's, so the recall itself is learned in the 32k runs. fp8: 400 steps learn it at 4k (the same section), so
# the LoRA runs only carry it to 32k, a job that should end at the same loss twice.
WARM_START_FROM = 8192
WARM_START_STEPS = {"paths": 150, "fp8": 400}
WARM_START_MODEL = "warm_start_model"       # the warm start's export, under the run root
LONG_RECALL_PAIRS = 8
RECALL_SPACING = 64
MAX_SUPERVISED = 4096
LONG_RECALL_ACCUMULATION = 2


# The fp8 comparison's runs: LoRA on all seven projections (TrainConfig's targets), the FP8 arm's overrides
# (--second-arm). Why this rate and rank: the adapters start at zero (the warm start's model), and 1e-3 is
# the rate at which the whole model learned this task at 4k, so one attempt neither crawls nor diverges;
# rank 32 with alpha 32 (scale 1: the rate means what it says) leaves a 1024-wide model's attention room to
# reach 8x further back, which is all the 32k runs have to learn.
FP8_LORA = ["train=lora", "train.lora_r=32", "train.lora_alpha=32", "optim.lr=1e-3"]
FP8_ARM = "train.fp8=true"


def warm_start_steps(seq_len: int, requested: int | None, compare: str = "paths") -> int:
    """The warm start's steps: those asked for, else the comparison's WARM_START_STEPS from WARM_START_FROM
    tokens."""
    if requested is not None:
        return requested
    return WARM_START_STEPS[compare] if seq_len >= WARM_START_FROM else 0


def recall_recipe(seq_len: int) -> list[str]:
    """Overrides of the recall task and accumulation for `seq_len` (none below LONG_RECALL_FROM: the demo's
    conf/data/recall.yaml)."""
    if seq_len < LONG_RECALL_FROM:
        return []
    repeats = min(seq_len // RECALL_SPACING, MAX_SUPERVISED // LONG_RECALL_PAIRS)
    return [f"data.num_pairs={LONG_RECALL_PAIRS}", f"data.repeats={repeats}", f"data.num_queries={LONG_RECALL_PAIRS}",
            "data.num_keys=64", "data.num_values=32", f"optim.grad_accum_steps={LONG_RECALL_ACCUMULATION}"]


# Layers of the fast run that are "full" (not checkpointed), from layer 0 up.
FULL_LAYERS = 2


def composed_config(model: str, overrides: list[str]):
    """The trainer's config for these overrides, as train.py composes it (fails early on a bad override)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conf.schema import register_configs
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", *overrides])
    return OmegaConf.to_container(cfg, resolve=False)


def cuda_visible(device: str) -> bool:
    if device == "cpu":
        return False
    import torch
    return torch.cuda.is_available()


def fast_settings(layers: int, on_cuda: bool, head_dim: int, kernels: str | None) -> tuple[str, list[str]]:
    """(kernels, memory overrides) of the fast run: Triton kernels on a GPU (`kernels=auto`, the reference,
    elsewhere and for a head dim the Triton attention lacks), the inputs of the top half of the layers
    offloaded, attention outputs kept and FULL_LAYERS full layers (these two only where the Triton attention
    runs: the trainer refuses them for the reference attention, which records nothing for them)."""
    if kernels is None:
        kernels = "triton" if on_cuda and _records("triton", "cuda", head_dim) else "auto"
    memory = [f"memory.gpu_layers={layers // 2}", "memory.offload=true"]
    if _records(kernels, "cuda" if on_cuda else "cpu", head_dim):
        # full layers only among the GPU-kept ones below the top one, so one layer input on the GPU stays
        # checkpointed with its attention output kept
        full = max(0, min(FULL_LAYERS, layers // 2 - 1))
        memory += [f"memory.full_layers={full}", "memory.kept_attention_layers=null"]
    else:
        memory += ["memory.full_layers=0", "memory.kept_attention_layers=0"]
    return kernels, memory


def _records(kernels: str, device_type: str, head_dim: int) -> bool:
    """Whether the attention `kernels` runs on that device records on an attention tape (kernels.attention)."""
    return choose_route(torch.device(device_type), head_dim, kernels, cudnn_fits=False).records


REFERENCE = ("reference", ["memory.offload=false", "memory.full_layers=0", "memory.kept_attention_layers=0"])


def arms(args, layers: int, on_cuda: bool, head_dim: int) -> dict[str, tuple[str, list[str]]]:
    """The comparison's two runs, by name: (kernels, the overrides that set this run apart). fp8: the fast
    kernels (kernels=auto unless --fast-kernels) with the planner's memory settings, the second run with
    --second-arm's overrides (FP8_ARM by default)."""
    if args.compare == "fp8":
        kernels = args.fast_kernels or "auto"
        second = FP8_ARM if args.second_arm is None else args.second_arm
        return {"bf16": (kernels, []), "fp8": (kernels, second.split())}
    return {"fast": fast_settings(layers, on_cuda, head_dim, args.fast_kernels), "reference": REFERENCE}


def long_overrides(compare: str) -> list[str]:
    """What both long runs train, beyond the recall recipe: fp8's LoRA (the warm start trains in full)."""
    return FP8_LORA if compare == "fp8" else []


def run_overrides(args, seq_len: int, steps: int, checkpoint_every: int = 0, job: list[str] = ()) -> list[str]:
    """A run's trainer overrides: length, steps, the recall recipe of that length, `job`, the user's last."""
    return [f"seq_len={seq_len}", f"batch_size={args.batch_size}", f"max_steps={steps}", f"seed={args.seed}",
            f"device={args.device}", f"log_every={args.log_every}", f"checkpoint.every_steps={checkpoint_every}",
            *COMMON, *recall_recipe(seq_len), *job, *args.overrides]


def train_command(args, kernels: str, memory: list[str], run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "train.py", f"model={args.model}", f"kernels={kernels}", *memory,
            f"output_dir={run_dir}", *overrides]


def check_warm_start(args) -> None:
    """Refuse a warm start that would train another task or another model than the long runs', and
    --second-arm outside the fp8 comparison."""
    if args.second_arm is not None and args.compare != "fp8":
        raise SystemExit("--second-arm sets the FP8 run apart from the bf16 one: give it with --compare fp8")
    if not args.warm_start_steps:
        return
    if args.seq_len >= LONG_RECALL_FROM > args.warm_start_len:
        raise SystemExit(f"--warm-start-len {args.warm_start_len} is below {LONG_RECALL_FROM}, where the recall task "
                         f"has other keys and values than at --seq-len {args.seq_len}: use --warm-start-len >= "
                         f"{LONG_RECALL_FROM}")
    if any(override.startswith("model.path=") for override in args.overrides):
        raise SystemExit("model.path is what the warm start hands to the long runs: give --warm-start-steps 0 to "
                         "start them from your model.path")
