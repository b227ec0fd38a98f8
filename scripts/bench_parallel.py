"""The same training job on 1 and on N GPUs of this machine (torchrun, sequence parallel over all of them),
in one run: a table of tokens/s, the speed-up over one GPU, and each run's measured and planned peak GPU
memory per rank; one JSON line per run on stdout's end.

    python scripts/bench_parallel.py --seq-len 131072 --gpus 1 2 [--steps 3] [override ...]

Overrides are the trainer's (default model=llama3_8b train=lora, random init). The first step is a warm-up;
tokens/s is the mean over the others (metrics.jsonl of each run, kept under --work-dir).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.metrics import METRICS_FILE, read_records

REPO = Path(__file__).resolve().parents[1]

DEFAULTS = ["model=llama3_8b", "train=lora", "logger.wandb.mode=disabled", "logger.progress_bar=false",
            "checkpoint.every_steps=0", "checkpoint.every_minutes=0", "checkpoint.save_random_base=false",
            "log_every=1"]


def run_job(gpus: int, seq_len: int, steps: int, overrides: list[str], run_dir: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               "train.py", *DEFAULTS, f"seq_len={seq_len}", f"max_steps={steps}", f"parallel.sequence={gpus}",
               f"output_dir={run_dir}", *overrides]
    with open(f"{run_dir}.log", "w") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    records = read_records(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else []
    timed = records[1:] or records
    result = {"gpus": gpus, "seq_len": seq_len, "exit": code, "steps": len(records), "overrides": overrides}
    if timed:
        result |= {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in timed),
                   "first_step_s": records[0]["step_time_s"],
                   "step_s": statistics.mean(r["step_time_s"] for r in timed),
                   "mfu": statistics.mean(r["mfu"] or 0 for r in timed),
                   "gpu_peak_gib": max(r.get("gpu_peak_gib") or 0 for r in records),
                   "gpu_planned_peak_gib": records[0].get("gpu_planned_peak_gib"),
                   "loss": timed[-1]["loss"]}
    else:
        result["log_tail"] = Path(f"{run_dir}.log").read_text()[-3000:]
    return result


def table(results: list[dict]) -> str:
    base = next((r.get("tokens_per_s") for r in results if r["gpus"] == 1), None)
    lines = ["| GPUs | tok/s | × one GPU | step s | first step s | MFU | peak/rank GiB | planned GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['gpus']} | failed (exit {r['exit']}) | | | | | | |")
            continue
        speedup = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        planned = r["gpu_planned_peak_gib"]
        lines.append(f"| {r['gpus']} | {r['tokens_per_s']:,.0f} | {speedup} | {r['step_s']:.1f} | "
                     f"{r['first_step_s']:.1f} | {100 * r['mfu']:.1f}% | {r['gpu_peak_gib']:.2f} | "
                     f"{'-' if planned is None else f'{planned:.2f}'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is a warm-up")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the runs' directories go")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the trainer config")
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_parallel-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for gpus in args.gpus:
        results.append(run_job(gpus, args.seq_len, args.steps, args.overrides, work / f"gpus{gpus}"))
        print(json.dumps(results[-1]), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
