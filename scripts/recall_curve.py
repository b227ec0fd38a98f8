"""Proof that the fast path trains: one recall job run twice, on the fast path and on the reference path,
with both accuracy curves (and losses) in one PNG.

    python scripts/recall_curve.py [--seq-len 32768] [--steps 1200] [--model recall_100m] \
        [--warm-start-steps 150 --warm-start-len 4096] [--concurrent] [--redraw RUN_ROOT] \
        [--out-png docs/recall_curve.png] [--run-root DIR] [--device auto] [override ...]

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

--warm-start-steps N (by default WARM_START_STEPS from WARM_START_FROM tokens): both runs start from one
model trained N steps at --warm-start-len tokens on the reference path (saved at step N, exported with
scripts/export.py, loaded through model.path); its curves are drawn in gray at steps 1-N..0. Why: from
random init the time to learn the task grows with the context past 4k tokens (docs/PERFORMANCE.md, "The fast
path trains"), as long-context models are pretrained short and then extended. 150 steps at 4k leave
recall_100m naming some value of its sequence but not the key's, so the recall itself is learned in the 32k
runs.

--redraw RUN_ROOT runs nothing: the table, PNG and summary again from the runs an earlier call left there.

Prints a table (each run's memory plan, final accuracy, step time), the largest difference between the two
accuracy curves, and a last line of JSON with the same numbers. Exit status 1 when a run failed or, on a
GPU, when the fast run did not offload layer inputs or keep attention outputs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.recall.job import (  # noqa: E402
    REFERENCE, RUNS, WARM_START_FROM, WARM_START_MODEL, WARM_START_STEPS, check_warm_start, composed_config,
    cuda_visible, fast_settings, run_overrides, train_command, warm_start_steps)
from scripts.recall.results import report  # noqa: E402
from scripts.recall.runs import finished_runs, run_jobs, warm_start  # noqa: E402
from trainer.architecture import architecture  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--model", default="recall_100m")
    parser.add_argument("--out-png", type=Path, default=REPO / "docs" / "recall_curve.png")
    parser.add_argument("--run-root", type=Path, default=None,
                        help="where the two runs' directories and logs go (default outputs/recall_curve/<time>)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--fast-kernels", default=None, choices=("auto", "triton"),
                        help="the fast run's kernels (default: triton on a GPU, else auto)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--warm-start-steps", type=int, default=None,
                        help="first train this many steps at --warm-start-len on the reference path; both runs "
                             f"start from that model (model.path). Default: {WARM_START_STEPS} from "
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
    args.warm_start_steps = warm_start_steps(args.seq_len, args.warm_start_steps)
    check_warm_start(args)

    shared = run_overrides(args, args.seq_len, args.steps)
    cfg = composed_config(args.model, shared)       # a bad override fails here, before any run
    if args.redraw:
        return report(args, cfg, args.redraw, *finished_runs(args.redraw, args))
    root = args.run_root or REPO / "outputs" / "recall_curve" / time.strftime("%Y-%m-%d_%H-%M-%S")
    for name in (*RUNS, "warm_start", WARM_START_MODEL):
        if (root / name).exists() and any((root / name).iterdir()):
            raise SystemExit(f"{root / name} is not empty: give a new --run-root (each run starts from scratch)")
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    warm = None
    if args.warm_start_steps:
        model_dir, warm = warm_start(args, root, env)
        shared.append(f"model.path={model_dir}")
    arch = architecture(cfg["model"])
    on_cuda = cuda_visible(args.device)
    fast_kernels, fast_memory = fast_settings(arch.num_hidden_layers, on_cuda, arch.head_dim, args.fast_kernels)
    commands = {name: (train_command(args, kernels, memory, root / name, shared), root / name)
                for name, (kernels, memory) in (("fast", (fast_kernels, fast_memory)), ("reference", REFERENCE))}
    runs = run_jobs(commands, env, args.concurrent)
    return report(args, cfg, root, runs, warm)


if __name__ == "__main__":
    result = main()
    failed = any(run["exit"] != 0 for run in result["runs"].values()) or result["fast_path_problems"]
    sys.exit(1 if failed else 0)
