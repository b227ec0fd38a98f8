"""What scripts/recall_curve.py reports of its two finished runs: each run's plan and training from its log and
metrics, how far apart the two accuracy curves and final losses are, the PNG of both, the table and the JSON
summary."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from trainer.console import RUN_LOG

SMOOTHING = 21      # steps in the centered moving average drawn over each curve and compared
FINAL_STEPS = 50    # the last steps whose mean loss and accuracy are a run's final ones
# Issue 41's quality gate of FP8 against bf16: final losses within 1% of the first run's, accuracies within 0.02.
LOSS_BOUND = 0.01
ACCURACY_BOUND = 0.02


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
        facts |= {"final_loss": records[-1]["loss"],
                  "final_loss_mean": statistics.mean(r["loss"] for r in records[-FINAL_STEPS:]),
                  "first_step_s": records[0]["step_time_s"],
                  "step_s": statistics.median(r["step_time_s"] for r in timed),
                  "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
                  "offload_d2h_gib_per_step": max(r.get("offload/d2h_gib") or 0 for r in records),
                  "gpu_peak_gib": max((r.get("gpu_peak_gib") or 0 for r in records), default=0) or None}
    if accuracy:
        facts |= {"final_accuracy": accuracy[-1], "last10_accuracy": statistics.mean(accuracy[-10:]),
                  "final_accuracy_mean": statistics.mean(accuracy[-FINAL_STEPS:]),
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
    """Largest |first - second| over the steps both logged, per step and on the moving averages."""
    first, second = (curve(run["records"], "accuracy") for run in runs.values())
    steps = sorted(set(first) & set(second))
    if not steps:
        return {}
    a, b = [first[s] for s in steps], [second[s] for s in steps]
    smooth_a, smooth_b = moving_average(a, window), moving_average(b, window)
    return {"steps_compared": len(steps), "max_abs_accuracy_diff": max(abs(x - y) for x, y in zip(a, b)),
            "max_abs_accuracy_diff_smoothed": max(abs(x - y) for x, y in zip(smooth_a, smooth_b)),
            "mean_abs_accuracy_diff": statistics.mean(abs(x - y) for x, y in zip(a, b))}


def final_differences(facts: dict[str, dict]) -> dict:
    """The second run's final loss relative to the first's and |difference| of their final accuracies (means of
    the last FINAL_STEPS steps, and the last step's), and whether issue 41's bounds hold on the means (None
    when a run has no final loss or accuracy)."""
    first, second = facts.values()
    keys = ("final_loss_mean", "final_loss", "final_accuracy_mean", "final_accuracy")
    if any(run.get(key) is None for run in (first, second) for key in keys):
        return {"bounds_hold": None}
    loss = abs(second["final_loss_mean"] - first["final_loss_mean"]) / first["final_loss_mean"]
    accuracy = abs(second["final_accuracy_mean"] - first["final_accuracy_mean"])
    return {"final_loss_rel_diff": loss,
            "last_loss_rel_diff": abs(second["final_loss"] - first["final_loss"]) / first["final_loss"],
            "final_accuracy_abs_diff": accuracy,
            "last_accuracy_abs_diff": abs(second["final_accuracy"] - first["final_accuracy"]),
            "loss_within_bound": loss <= LOSS_BOUND, "accuracy_within_bound": accuracy <= ACCURACY_BOUND,
            "bounds_hold": loss <= LOSS_BOUND and accuracy <= ACCURACY_BOUND}


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
    # the second run dashed: equal curves stay visible
    looks = dict(zip(runs, (("tab:blue", "-"), ("tab:orange", "--"))))
    for axes, metric in ((top, "accuracy"), (bottom, "loss")):
        for name, (color, style) in looks.items():
            points = curve(runs[name]["records"], metric)
            if not points:
                continue
            steps, values = list(points), list(points.values())
            axes.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
            axes.plot(steps, moving_average(values, window), color=color, linewidth=1.8,
                      linestyle=style, label=f"{label(name, facts[name])}, {window}-step mean")
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


def table(facts: dict[str, dict], difference: dict, final: dict) -> str:
    def number(value, spec):
        return "-" if value is None else format(value, spec)
    lines = [f"| run | kernels | memory plan | final acc | last-10 acc | last-{FINAL_STEPS} acc | final loss | "
             f"last-{FINAL_STEPS} loss | step s (median) | first step s | tok/s | offloaded GiB/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in facts.items():
        if f["exit"] != 0 and not f["steps"]:
            lines.append(f"| {name} | failed (exit {f['exit']}) | | | | | | | | | | |")
            continue
        lines.append(f"| {name}{'' if f['exit'] == 0 else ' (exit ' + str(f['exit']) + ')'} | "
                     f"{f.get('kernels', '?')} | {plan_text(f)} | {number(f.get('final_accuracy'), '.3f')} | "
                     f"{number(f.get('last10_accuracy'), '.3f')} | {number(f.get('final_accuracy_mean'), '.3f')} | "
                     f"{number(f.get('final_loss'), '.4f')} | {number(f.get('final_loss_mean'), '.4f')} | "
                     f"{number(f.get('step_s'), '.3f')} | {number(f.get('first_step_s'), '.1f')} | "
                     f"{number(f.get('tokens_per_s'), ',.0f')} | {number(f.get('offload_d2h_gib_per_step'), '.2f')} |")
    first, second = facts
    if difference:
        lines.append(f"accuracy curves over {difference['steps_compared']} steps: max |{first} - {second}| "
                     f"{difference['max_abs_accuracy_diff']:.3f} per step, "
                     f"{difference['max_abs_accuracy_diff_smoothed']:.3f} on the {SMOOTHING}-step means, "
                     f"mean {difference['mean_abs_accuracy_diff']:.3f}")
    else:
        lines.append("accuracy curves: no step logged accuracy in both runs")
    if final["bounds_hold"] is not None:
        def verdict(holds: bool) -> str:
            return "holds" if holds else "FAILS"
        lines.append(f"final ({FINAL_STEPS}-step means): {second}'s loss {final['final_loss_rel_diff']:.2%} from "
                     f"{first}'s (bound {LOSS_BOUND:.0%}: {verdict(final['loss_within_bound'])}), accuracy "
                     f"{final['final_accuracy_abs_diff']:.3f} apart (bound {ACCURACY_BOUND}: "
                     f"{verdict(final['accuracy_within_bound'])})")
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
    facts = {name: run_facts(run) for name, run in runs.items()}
    difference, final = accuracy_difference(runs, SMOOTHING), final_differences(facts)
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
    lora = (f", LoRA r={cfg['train']['lora_r']} on {len(cfg['train']['lora_target_modules'])} projections"
            if cfg["train"]["mode"] == "lora" else "")
    title = "\n".join([
        f"Recall at {cfg['seq_len']:,} tokens: {args.model} ({params if params is not None else '?'}M parameters)"
        f"{lora}, {steps} steps of {sequences} sequence{'s' * (sequences > 1)}, {device}", start_text,
        *(f"{name}: {path_text(f)}" for name, f in facts.items()),
        f"{supervised:,} supervised tokens per sequence" + (f", chance accuracy 1/{cfg['data']['num_values']}"
                                                            if chance else "")])
    # A model that names some value of this sequence without binding it to its key scores 1/num_pairs.
    unbound = 1 / cfg["data"]["num_pairs"] if chance and cfg["data"]["num_pairs"] < cfg["data"]["num_values"] else None
    draw(runs, facts, title, chance, args.out_png, SMOOTHING, unbound, warm, args.warm_start_len)

    problems = fast_path_problems(facts["fast"]) if "fast" in facts else []     # the paths comparison's run
    summary = {"compare": args.compare, "model": args.model, "params_m": params, "seq_len": cfg["seq_len"],
               "steps": cfg["max_steps"], "train": cfg["train"]["mode"],
               "batch_size": cfg["batch_size"], "sequences_per_step": sequences, "device": device,
               "png": str(args.out_png), "run_root": str(root),
               "supervised_per_sequence": supervised, "concurrent": args.concurrent, "warm_start": warm_facts,
               "runs": facts, **difference, **final,
               "fast_path_problems": problems}
    print(f"{args.model} ({params}M parameters), seq_len {cfg['seq_len']}, {steps} steps, {device}")
    print(table(facts, difference, final))
    if args.concurrent:
        print("the two runs ran at once, sharing the device: their step times are not each one's alone")
    for problem in problems:
        print(f"WARNING: the fast run did not exercise the fast path: {problem}")
    print(f"wrote {args.out_png}")
    print(json.dumps(summary), flush=True)
    return summary
