"""Proof that the fast path trains: one recall job run twice, on the fast path and on the reference path,
with both accuracy curves (and losses) in one PNG.

    python scripts/recall_curve.py [--seq-len 32768] [--steps 1200] [--model recall_100m] \
        [--warm-start-steps 150 --warm-start-len 4096] [--concurrent] [--redraw RUN_ROOT] \
        [--out-png docs/recall_curve.png] [--run-root DIR] [--device auto] [override ...]

The two runs are `train.py` processes with the same model, seed, data and steps, each in its own output_dir
under --run-root:

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
random init the time to learn the task grows with the context past 4k tokens (measured 2026-11-25, lr 1e-3,
docs/BENCHMARKS.md: on the H100 recall_100m reaches 0.84 in 400 steps at 4k, 0.21 at 8k, and is at 0.18
after 600 steps at 32k; the tiny model learns by step ~190 at 8k on the CPU, and is at 0.08 after 400 steps
at 32k on the H100), as long-context models are pretrained short and then extended. 150 steps at 4k leave
recall_100m at 0.12, about 1/8: it names some value of its sequence but not the key's, so the recall itself
is learned in the 32k runs.

--redraw RUN_ROOT runs nothing: the table, PNG and summary again from the runs an earlier call left there.

Prints a table (each run's memory plan, final accuracy, step time), the largest difference between the two
accuracy curves, and a last line of JSON with the same numbers. Exit status 1 when a run failed or, on a
GPU, when the fast run did not offload layer inputs or keep attention outputs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kernels.attention import choose_route  # noqa: E402
from trainer.build import architecture  # noqa: E402
from trainer.console import RUN_LOG  # noqa: E402
from trainer.metrics import METRICS_FILE, read_records  # noqa: E402

RUNS = ("fast", "reference")
COMMON = ["logger.wandb.mode=disabled", "logger.progress_bar=false", "checkpoint.every_minutes=0",
          "checkpoint.save_random_base=false", "resume=false"]
# The recall task at long context (from LONG_RECALL_FROM tokens): LONG_RECALL_PAIRS facts, each recurring once
# per RECALL_SPACING tokens, at most 4,096 supervised tokens per sequence (trainer.step logs accuracy up to
# there), and two sequences per step (gradient accumulation: each micro-batch stays under that limit).
# Measured with the tiny model at 2k tokens (the same recipe scaled down): the learning starts after ~200
# steps like this, never within 300 with half the recurrences (16 facts x 16) or one sequence per step. On
# the H100 at 32k from random init, 400 steps at lr 6e-4 took recall_100m (12 narrow layers, then 2 wide
# ones) only to 0.13-0.14, the fast and reference curves together (docs/BENCHMARKS.md). Learning is a sudden
# change: the tiny model at 4k tokens stays near chance until step ~175 and is at 0.99 by step 225.
LONG_RECALL_FROM = 4096
# From WARM_START_FROM tokens both runs start from a model trained WARM_START_STEPS steps at 4k (--warm-start-*):
# from random init recall_100m is at 0.21 after 400 steps at 8k and 0.18 after 600 at 32k, against 0.84 at 4k.
WARM_START_FROM = 8192
WARM_START_STEPS = 150
WARM_START_MODEL = "warm_start_model"       # the warm start's export, under the run root
LONG_RECALL_PAIRS = 8
RECALL_SPACING = 64
MAX_SUPERVISED = 4096
LONG_RECALL_ACCUMULATION = 2


def warm_start_steps(seq_len: int, requested: int | None) -> int:
    """The warm start's steps: those asked for, else WARM_START_STEPS from WARM_START_FROM tokens."""
    if requested is not None:
        return requested
    return WARM_START_STEPS if seq_len >= WARM_START_FROM else 0


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
SMOOTHING = 21      # steps in the centered moving average drawn over each curve and compared


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
        kernels = "triton" if on_cuda and choose_route(torch.device("cuda"), head_dim, "triton").records else "auto"
    memory = [f"memory.gpu_layers={layers // 2}", "memory.offload=true"]
    if choose_route(torch.device("cuda" if on_cuda else "cpu"), head_dim, kernels).records:
        # full layers only among the GPU-kept ones below the top one, so one layer input on the GPU stays
        # checkpointed with its attention output kept
        full = max(0, min(FULL_LAYERS, layers // 2 - 1))
        memory += [f"memory.full_layers={full}", "memory.kept_attention_layers=null"]
    else:
        memory += ["memory.full_layers=0", "memory.kept_attention_layers=0"]
    return kernels, memory


REFERENCE = ("reference", ["memory.offload=false", "memory.full_layers=0", "memory.kept_attention_layers=0"])


def run_overrides(args, seq_len: int, steps: int, checkpoint_every: int = 0) -> list[str]:
    """A run's trainer overrides: length, steps, the recall recipe of that length, the user's last."""
    return [f"seq_len={seq_len}", f"batch_size={args.batch_size}", f"max_steps={steps}", f"seed={args.seed}",
            f"device={args.device}", f"log_every={args.log_every}", f"checkpoint.every_steps={checkpoint_every}",
            *COMMON, *recall_recipe(seq_len), *args.overrides]


def train_command(args, kernels: str, memory: list[str], run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "train.py", f"model={args.model}", f"kernels={kernels}", *memory,
            f"output_dir={run_dir}", *overrides]


def run_result(name: str, code: int, wall_s: float, log: str, run_dir: Path) -> dict:
    """A finished run as report() takes it: its exit status, wall time and metrics records."""
    metrics = Path(run_dir) / METRICS_FILE
    return {"name": name, "exit": code, "wall_s": wall_s, "log": str(log), "run_dir": str(run_dir),
            "records": read_records(metrics) if metrics.is_file() else []}


def start_job(name: str, command: list[str], run_dir: Path, env: dict) -> dict:
    """Start one train.py process; its console output goes to <run_root>/<name>.log."""
    log_path = run_dir.parent / f"{name}.log"
    print(f"[{name}] {' '.join(command[1:])}", flush=True)
    with open(log_path, "w") as log:   # the child keeps its own descriptor
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    return {"name": name, "process": process, "started": time.perf_counter(), "log": str(log_path),
            "run_dir": str(run_dir)}


def finish_job(job: dict) -> dict:
    """Wait for a started job; its exit status, wall time and metrics records."""
    code = job["process"].wait()
    wall = time.perf_counter() - job["started"]
    print(f"[{job['name']}] exit {code} after {wall:.0f} s (log {job['log']})", flush=True)
    if code != 0:
        print(Path(job["log"]).read_text(errors="replace")[-3000:], flush=True)
    return run_result(job["name"], code, wall, job["log"], job["run_dir"])


def run_jobs(commands: dict[str, tuple[list[str], Path]], env: dict, concurrent: bool) -> dict[str, dict]:
    """Run each (command, run_dir) one after the other, or all at once; a job still running when this
    stops early (an error, Ctrl-C) is terminated rather than left holding the GPU."""
    jobs, runs = {}, {}
    try:
        for name, (command, run_dir) in commands.items():
            jobs[name] = start_job(name, command, run_dir, env)
            if not concurrent:
                runs[name] = finish_job(jobs[name])
        for name in commands:
            if name not in runs:
                runs[name] = finish_job(jobs[name])
    finally:
        for job in jobs.values():
            if job["process"].poll() is None:
                job["process"].terminate()
                try:
                    job["process"].wait(timeout=30)
                except subprocess.TimeoutExpired:
                    job["process"].kill()
    return runs


def warm_start(args, root: Path, env: dict) -> tuple[Path, dict]:
    """Train the model args.warm_start_steps steps at args.warm_start_len tokens on the reference path, save
    that step and export it as a Hugging Face directory that both long runs load (model.path). Returns the
    directory and the finished job."""
    steps, length = args.warm_start_steps, args.warm_start_len
    run_dir = root / "warm_start"
    command = train_command(args, *REFERENCE, run_dir, run_overrides(args, length, steps, checkpoint_every=steps))
    job = run_jobs({"warm_start": (command, run_dir)}, env, concurrent=False)["warm_start"]
    if job["exit"] != 0:
        raise SystemExit(f"the warm start failed (exit {job['exit']}): {job['log']}")
    model_dir = root / WARM_START_MODEL
    export = subprocess.run([sys.executable, "scripts/export.py", str(run_dir / "checkpoints" / f"step-{steps}"),
                             str(model_dir)], cwd=REPO, env=env, capture_output=True, text=True)
    if export.returncode != 0:
        raise SystemExit(f"exporting the warm start failed:\n{export.stdout[-2000:]}{export.stderr[-2000:]}")
    return model_dir, job


def run_facts(run: dict) -> dict:
    """What the run's train.log says about its plan and size, and what its metrics say about its training."""
    text = Path(run["log"]).read_text(errors="replace")
    run_log = Path(run["run_dir"]) / RUN_LOG
    if run_log.is_file():
        text = run_log.read_text(errors="replace")
    facts = {"exit": run["exit"], "wall_s": round(run["wall_s"], 1), "steps": len(run["records"])}
    plan = re.search(r"memory plan: checkpointing (\w+), layer inputs gpu=(\d+) host=(\d+) recomputed=(\d+), "
                     r"(?:full layers=(\d+), )?attention outputs kept gpu=(\d+) host=(\d+)", text)
    if plan:
        facts["plan"] = {"checkpointing": plan[1], "inputs_gpu": int(plan[2]), "inputs_host": int(plan[3]),
                         "inputs_recomputed": int(plan[4]), "full_layers": int(plan[5] or 0),
                         "attention_kept_gpu": int(plan[6]), "attention_kept_host": int(plan[7])}
    size = re.search(r"parameters\s+[\d.]+M trainable of ([\d.]+)M", text)
    kernels = re.search(r"device=(\w+)\S*, kernels=(\w+)", text)       # device=cuda:0, kernels=triton
    gpu = re.search(r", gpu=([^,\n]+)", text)                          # trainer.loop.gpu_name
    if gpu:
        facts["gpu"] = gpu[1].strip()
    if size:
        facts["params_m"] = float(size[1])
    if kernels:
        facts["device"], facts["kernels"] = kernels[1], kernels[2]
    records = run["records"]
    accuracy = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    if records:
        timed = records[1:] or records      # the first step compiles and tunes the kernels
        facts |= {"final_loss": records[-1]["loss"], "first_step_s": records[0]["step_time_s"],
                  "step_s": statistics.median(r["step_time_s"] for r in timed),
                  "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
                  "offload_d2h_gib_per_step": max(r.get("offload/d2h_gib") or 0 for r in records),
                  "gpu_peak_gib": max((r.get("gpu_peak_gib") or 0 for r in records), default=0) or None}
    if accuracy:
        facts |= {"final_accuracy": accuracy[-1], "last10_accuracy": statistics.mean(accuracy[-10:]),
                  "first10_accuracy": statistics.mean(accuracy[:10])}
    return facts


def moving_average(values: list[float], window: int) -> list[float]:
    """Centered mean over `window` points (fewer at the ends), so a smoothed curve does not lag its steps."""
    half, prefix = window // 2, [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    spans = ((max(0, i - half), min(len(values), i + half + 1)) for i in range(len(values)))
    return [(prefix[end] - prefix[start]) / (end - start) for start, end in spans]


def curve(records: list[dict], name: str) -> dict[int, float]:
    return {r["step"]: r[name] for r in records if r.get(name) is not None}


def accuracy_difference(runs: dict[str, dict], window: int) -> dict:
    """Largest |fast - reference| over the steps both logged, per step and on the moving averages."""
    fast, reference = (curve(runs[name]["records"], "accuracy") for name in RUNS)
    steps = sorted(set(fast) & set(reference))
    if not steps:
        return {}
    a, b = [fast[s] for s in steps], [reference[s] for s in steps]
    smooth_a, smooth_b = moving_average(a, window), moving_average(b, window)
    return {"steps_compared": len(steps), "max_abs_accuracy_diff": max(abs(x - y) for x, y in zip(a, b)),
            "max_abs_accuracy_diff_smoothed": max(abs(x - y) for x, y in zip(smooth_a, smooth_b)),
            "mean_abs_accuracy_diff": statistics.mean(abs(x - y) for x, y in zip(a, b))}


def plan_text(facts: dict) -> str:
    plan = facts.get("plan")
    if not plan:
        return "no plan logged"
    return (f"inputs gpu={plan['inputs_gpu']} host={plan['inputs_host']}, full={plan['full_layers']}, "
            f"attention kept gpu={plan['attention_kept_gpu']} host={plan['attention_kept_host']}")


def path_text(facts: dict) -> str:
    """One run's kernels and memory plan, in words, for the PNG's title."""
    plan = facts.get("plan")
    if not plan:
        return f"kernels={facts.get('kernels', '?')} (no plan logged)"
    where = "GPU" if facts.get("device") == "cuda" else "device"
    kept = plan["attention_kept_gpu"] + plan["attention_kept_host"]
    parts = [f"kernels={facts.get('kernels', '?')}", f"{plan['inputs_gpu']} layer inputs on the {where}",
             f"{plan['inputs_host']} offloaded to pinned host memory", f"{plan['full_layers']} full layers",
             f"{kept} attention outputs kept" if kept else "attention recomputed in the backward"]
    return ", ".join(parts)


def label(name: str, facts: dict) -> str:
    step = f", {facts['step_s']:.2f} s/step" if "step_s" in facts else ""
    return f"{name} (kernels={facts.get('kernels', '?')}{step})"


def draw(runs: dict[str, dict], facts: dict[str, dict], title: str, chance: float | None, png: Path,
         window: int, unbound: float | None = None, warm: dict | None = None, warm_len: int = 0) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8.5), sharex=True)
    colors = {"fast": "tab:blue", "reference": "tab:orange"}
    styles = {"fast": "-", "reference": "--"}      # the reference dashed: equal curves stay visible
    for axes, metric in ((top, "accuracy"), (bottom, "loss")):
        for name in RUNS:
            points = curve(runs[name]["records"], metric)
            if not points:
                continue
            steps, values = list(points), list(points.values())
            axes.plot(steps, values, color=colors[name], alpha=0.3, linewidth=0.8)
            axes.plot(steps, moving_average(values, window), color=colors[name], linewidth=1.8,
                      linestyle=styles[name], label=f"{label(name, facts[name])}, {window}-step mean")
        points = curve(warm["records"], metric) if warm else {}
        if points:      # the warm start's last step at 0, so its step N + 1 would be the long runs' step 1
            last = max(r["step"] for r in warm["records"])
            steps, values = [step - last for step in points], list(points.values())
            axes.plot(steps, moving_average(values, window), color="gray", linewidth=1.5,
                      label=f"warm start at {warm_len:,} tokens (reference), {window}-step mean")
            axes.axvline(0, color="gray", linewidth=0.8)
        axes.set_ylabel(metric)
        axes.grid(alpha=0.3)
    if chance:
        top.axhline(chance, color="gray", linestyle="--", linewidth=1, label=f"chance (1/{round(1 / chance)})")
    if unbound:
        top.axhline(unbound, color="gray", linestyle=":", linewidth=1,
                    label=f"a value of the sequence, not the key's (1/{round(1 / unbound)})")
    top.set_ylim(0, 1.02)
    top.legend(loc="upper left", fontsize=9)
    bottom.set_xlabel("step")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    plt.close(figure)


def device_name(facts: dict[str, dict]) -> str:
    """The GPU the runs logged (older logs name none: then this machine's, or "cuda"), or "CPU"."""
    if any(f.get("device") == "cuda" for f in facts.values()):
        logged = next((f["gpu"] for f in facts.values() if f.get("gpu")), None)
        if logged:
            return logged
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
    return "CPU"


def table(facts: dict[str, dict], difference: dict) -> str:
    def number(value, spec):
        return "-" if value is None else format(value, spec)
    lines = ["| run | kernels | memory plan | final acc | last-10 acc | final loss | step s (median) | first step s "
             "| tok/s | offloaded GiB/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in RUNS:
        f = facts[name]
        if f["exit"] != 0 and not f["steps"]:
            lines.append(f"| {name} | failed (exit {f['exit']}) | | | | | | | | |")
            continue
        lines.append(f"| {name}{'' if f['exit'] == 0 else ' (exit ' + str(f['exit']) + ')'} | "
                     f"{f.get('kernels', '?')} | {plan_text(f)} | {number(f.get('final_accuracy'), '.3f')} | "
                     f"{number(f.get('last10_accuracy'), '.3f')} | {number(f.get('final_loss'), '.4f')} | "
                     f"{number(f.get('step_s'), '.3f')} | {number(f.get('first_step_s'), '.1f')} | "
                     f"{number(f.get('tokens_per_s'), ',.0f')} | {number(f.get('offload_d2h_gib_per_step'), '.2f')} |")
    if difference:
        lines.append(f"accuracy curves over {difference['steps_compared']} steps: max |fast - reference| "
                     f"{difference['max_abs_accuracy_diff']:.3f} per step, "
                     f"{difference['max_abs_accuracy_diff_smoothed']:.3f} on the {SMOOTHING}-step means, "
                     f"mean {difference['mean_abs_accuracy_diff']:.3f}")
    else:
        lines.append("accuracy curves: no step logged accuracy in both runs")
    return "\n".join(lines)


def fast_path_problems(facts: dict) -> list[str]:
    """On a GPU, what the fast run should have exercised and did not."""
    if facts.get("device") != "cuda":
        return []
    plan, problems = facts.get("plan") or {}, []
    if facts.get("kernels") != "triton":
        problems.append(f"kernels={facts.get('kernels')}, not triton")
    if not plan.get("inputs_host"):
        problems.append("no layer input was offloaded to the host")
    if not plan.get("attention_kept_gpu", 0) + plan.get("attention_kept_host", 0):
        problems.append("no attention output was kept")
    if not facts.get("offload_d2h_gib_per_step"):
        problems.append("the memory engine copied nothing to the host")
    return problems


def report(args, cfg: dict, root: Path, runs: dict[str, dict], warm: dict | None) -> dict:
    """The finished runs' table, PNG and JSON summary (printed; the summary is returned)."""
    facts = {name: run_facts(runs[name]) for name in RUNS}
    difference = accuracy_difference(runs, SMOOTHING)
    params = next((f["params_m"] for f in facts.values() if "params_m" in f), None)
    device = device_name(facts)
    steps = max(f["steps"] for f in facts.values())
    sequences = cfg["batch_size"] * cfg["optim"]["grad_accum_steps"]
    supervised = (cfg["data"]["num_pairs"] * (cfg["data"]["repeats"] - 1) + cfg["data"]["num_queries"])
    chance = 1 / cfg["data"]["num_values"] if cfg["data"]["name"] == "recall" else None
    warm_facts = None
    start_text = "from random init"
    if warm:
        warm_facts = run_facts(warm) | {"seq_len": args.warm_start_len}
        start_text = (f"from a warm start of {warm_facts['steps']} steps at {args.warm_start_len:,} tokens on the "
                      f"reference path (accuracy {warm_facts.get('last10_accuracy', float('nan')):.3f} over its "
                      "last 10)")
    title = "\n".join([
        f"Recall at {cfg['seq_len']:,} tokens: {args.model} ({params if params is not None else '?'}M parameters), "
        f"{steps} steps of {sequences} sequence{'s' * (sequences > 1)}, {device}", start_text,
        f"fast: {path_text(facts['fast'])}",
        f"reference: {path_text(facts['reference'])}",
        f"{supervised:,} supervised tokens per sequence" + (f", chance accuracy 1/{cfg['data']['num_values']}"
                                                            if chance else "")])
    # A model that names some value of this sequence without binding it to its key scores 1/num_pairs.
    unbound = 1 / cfg["data"]["num_pairs"] if chance and cfg["data"]["num_pairs"] < cfg["data"]["num_values"] else None
    draw(runs, facts, title, chance, args.out_png, SMOOTHING, unbound, warm, args.warm_start_len)

    problems = fast_path_problems(facts["fast"])
    summary = {"model": args.model, "params_m": params, "seq_len": cfg["seq_len"], "steps": cfg["max_steps"],
               "batch_size": cfg["batch_size"], "sequences_per_step": sequences, "device": device,
               "png": str(args.out_png), "run_root": str(root),
               "supervised_per_sequence": supervised, "concurrent": args.concurrent, "warm_start": warm_facts,
               "runs": facts, **difference,
               "fast_path_problems": problems}
    print(f"{args.model} ({params}M parameters), seq_len {cfg['seq_len']}, {steps} steps, {device}")
    print(table(facts, difference))
    if args.concurrent:
        print("the two runs ran at once, sharing the device: their step times are not each one's alone")
    for problem in problems:
        print(f"WARNING: the fast run did not exercise the fast path: {problem}")
    print(f"wrote {args.out_png}")
    print(json.dumps(summary), flush=True)
    return summary


def check_warm_start(args) -> None:
    """Refuse a warm start that would train another task or another model than the long runs'."""
    if not args.warm_start_steps:
        return
    if args.seq_len >= LONG_RECALL_FROM > args.warm_start_len:
        raise SystemExit(f"--warm-start-len {args.warm_start_len} is below {LONG_RECALL_FROM}, where the recall task "
                         f"has other keys and values than at --seq-len {args.seq_len}: use --warm-start-len >= "
                         f"{LONG_RECALL_FROM}")
    if any(override.startswith("model.path=") for override in args.overrides):
        raise SystemExit("model.path is what the warm start hands to the long runs: give --warm-start-steps 0 to "
                         "start them from your model.path")


def finished_runs(root: Path, args) -> tuple[dict[str, dict], dict | None]:
    """The runs (and warm start) under an earlier run root, as run_jobs returns them; a run counts as
    finished (exit 0) when its metrics have every step (--steps, --warm-start-steps)."""
    def finished(name: str, steps: int) -> dict:
        run = run_result(name, 0, float("nan"), root / f"{name}.log", root / name)
        return run | {"exit": 0 if len(run["records"]) == steps else 1}
    warm = finished("warm_start", args.warm_start_steps) if (root / "warm_start").is_dir() else None
    return {name: finished(name, args.steps) for name in RUNS}, warm


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
