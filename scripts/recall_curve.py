"""Proof that the fast path trains: one recall job run twice, on the fast path and on the reference path,
with both accuracy curves (and losses) in one PNG; with --compare fp8, issue 41's FP8 quality gate instead.

    python scripts/recall_curve.py [--compare paths] [--seq-len 32768] [--steps 1200] [--model recall_100m] \
        [--warm-start-steps 150 --warm-start-len 4096] [--concurrent] [--redraw RUN_ROOT] \
        [--out-png docs/recall_curve.png] [--run-root DIR] [--device auto] [override ...]
    python scripts/recall_curve.py --compare fp8 [--steps 1000] [--second-arm train.fp8=true] [--concurrent] ...

The two runs are `train.py` processes with the same model, seed, data and steps, each in its own output_dir
under --run-root (the job: scripts/recall/job.py; its processes: runs.py; the table, PNG and summary:
results.py):

- fast: `kernels=triton` (every op through its Triton kernel; attention through our flash attention, not
  cuDNN), with memory settings that force the memory engine on where everything would fit: the inputs of
  the lower half of the layers stay on the GPU, those of the upper half are offloaded to pinned host memory
  (`memory.gpu_layers`), every checkpointed layer keeps its attention output for the backward
  (`memory.kept_attention_layers=null`: all, the GPU has room), and with 4 layers or more up to FULL_LAYERS
  of the GPU-kept ones are "full" (not checkpointed, `memory.full_layers`). Left to itself the planner would
  make every layer of a small model a full one, offloading and keeping nothing. Where the Triton attention
  does not run (no GPU, or a head dim it lacks) the fast run takes `kernels=auto` and no kept attention or
  full layers (the trainer refuses them there).
- reference: `kernels=reference` (plain PyTorch ops, kernels/reference.py), every layer input kept on the GPU
  (`memory.offload=false`), attention recomputed in the backward (the reference records none).

From LONG_RECALL_FROM tokens the recall task is made for long context (recall_recipe): 8 facts, each
recurring every 64 tokens (512 times at 32k), 8 queries: 4,096 supervised tokens per sequence, trainer.step's
limit for logging accuracy, and two sequences per step through gradient accumulation. Shorter sequences keep
conf/data/recall.yaml's demo settings. Overrides after the options go to every run (`optim.lr=1e-3`, ...).

--warm-start-steps N (by default WARM_START_STEPS[--compare] from WARM_START_FROM tokens): both runs start from one
model trained N steps at --warm-start-len tokens on the reference path (saved at step N, exported with
scripts/export.py, loaded through model.path); its curves are drawn in gray at steps 1-N..0. Why: from
random init the time to learn the task grows with the context past 4k tokens (docs/PERFORMANCE.md, "The fast
path trains"), as long-context models are pretrained short and then extended. 150 steps at 4k leave
recall_100m naming some value of its sequence but not the key's, so the recall itself is learned in the 32k
runs.

--compare fp8 (default PNG docs/fp8_quality.png, run root outputs/fp8_quality/<time>): from a warm start
of 400 steps at 4k (by then recall_100m recalls at 4k), two LoRA runs (scripts/recall/job.py FP8_LORA: all
seven projections, r 32, lr 1e-3) named bf16 and fp8, the same but for --second-arm's overrides in the second
(`train.fp8=true`: the frozen base's products in FP8, which only a GPU with FP8 tensor cores runs), both with
the fast kernels (kernels=auto, --fast-kernels) and the planner's memory settings. The summary adds the
second run's final loss relative to the first's and the difference of their final accuracies (means of the
last 50 steps) and whether issue 41's bounds (1%, 0.02) hold; `bounds_hold` in the JSON.

--redraw RUN_ROOT runs nothing: the table, PNG and summary again from the runs an earlier call left there.

Prints a table (each run's memory plan, final accuracy and loss, step time), the largest difference between
the two accuracy curves, the difference of the final losses and accuracies, and a last line of JSON with the
same numbers. Exit status 1 when a run failed or, on a GPU, when the fast run did not offload layer inputs or
keep attention outputs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from scripts.recall.job import (
    COMPARISONS, DEFAULT_STEPS, FP8_ARM, WARM_START_FROM, WARM_START_MODEL, WARM_START_STEPS, arms,
    check_warm_start, composed_config, cuda_visible, long_overrides, run_overrides, train_command,
    warm_start_steps)
from scripts.recall.results import report
from scripts.recall.runs import finished_runs, run_jobs, warm_start
from trainer.architecture import architecture

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", default="paths", choices=tuple(COMPARISONS),
                        help="paths: the fast path against the reference; fp8: LoRA with train.fp8=true against bf16")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=None, help=f"default {DEFAULT_STEPS}, by --compare")
    parser.add_argument("--model", default="recall_100m")
    parser.add_argument("--out-png", type=Path, default=None,
                        help=f"default docs/<name>.png, the name by --compare: {COMPARISONS}")
    parser.add_argument("--run-root", type=Path, default=None,
                        help="where the two runs' directories and logs go (default outputs/<name>/<time>)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--fast-kernels", default=None, choices=("auto", "triton"),
                        help="the fast run's kernels (default: triton on a GPU, else auto); both runs' with "
                             "--compare fp8 (default auto)")
    parser.add_argument("--second-arm", default=None, metavar="OVERRIDES",
                        help=f"--compare fp8: the overrides, space-separated, that set the second run apart "
                             f"(default {FP8_ARM!r})")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--warm-start-steps", type=int, default=None,
                        help="first train this many steps at --warm-start-len on the reference path; both runs "
                             f"start from that model (model.path). Default: {WARM_START_STEPS} by --compare, from "
                             f"{WARM_START_FROM:,} tokens, else none")
    parser.add_argument("--warm-start-len", type=int, default=4096)
    parser.add_argument("--concurrent", action="store_true",
                        help="run both at once (on one GPU they share it: their step times are not each alone's)")
    parser.add_argument("--redraw", type=Path, default=None, metavar="RUN_ROOT",
                        help="run nothing: the table, PNG and summary again from the runs under RUN_ROOT (give "
                             "the options they ran with)")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides of the trainer config, for every run (the warm start's too)")
    args = parser.parse_args(argv)
    job_name = COMPARISONS[args.compare]
    args.steps = DEFAULT_STEPS[args.compare] if args.steps is None else args.steps
    args.out_png = args.out_png or REPO / "docs" / f"{job_name}.png"
    args.warm_start_steps = warm_start_steps(args.seq_len, args.warm_start_steps, args.compare)
    check_warm_start(args)

    shared = run_overrides(args, args.seq_len, args.steps, job=long_overrides(args.compare))
    cfg = composed_config(args.model, shared)       # a bad override fails here, before any run
    arch = architecture(cfg["model"])
    settings = arms(args, arch.num_hidden_layers, cuda_visible(args.device), arch.head_dim)
    if args.redraw:
        return report(args, cfg, args.redraw, *finished_runs(args.redraw, args, settings))
    root = args.run_root or REPO / "outputs" / job_name / time.strftime("%Y-%m-%d_%H-%M-%S")
    for name in (*settings, "warm_start", WARM_START_MODEL):
        if (root / name).exists() and any((root / name).iterdir()):
            raise SystemExit(f"{root / name} is not empty: give a new --run-root (each run starts from scratch)")
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    warm = None
    if args.warm_start_steps:
        model_dir, warm = warm_start(args, root, env)
        shared.append(f"model.path={model_dir}")
    commands = {name: (train_command(args, kernels, own, root / name, shared), root / name)
                for name, (kernels, own) in settings.items()}
    return report(args, cfg, root, run_jobs(commands, env, args.concurrent), warm)


if __name__ == "__main__":
    result = main()
    failed = (any(run["exit"] != 0 for run in result["runs"].values()) or result["fast_path_problems"]
              or result.get("bounds_hold") is False)
    sys.exit(1 if failed else 0)
