"""Plot a run's metrics.jsonl (no W&B needed) into PNGs in the run directory.

    .venv/bin/python scripts/report.py <run dir>

Writes report_loss.png, report_accuracy.png (when the run logged accuracy), report_throughput.png and
report_memory.png, each titled with the run directory, and prints a one-paragraph summary. A metric that is
zero throughout (e.g. pinned memory on a run that offloads nothing) is left out of its plot.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.metrics import METRICS_FILE, read_records  # noqa: E402
# PNG name -> (title, y label, metrics drawn: a name, or a suffix that picks every metric ending in it,
# so the memory engine's GiB metrics are drawn next to the trainer's; whether a metric that is zero
# throughout measured nothing and is left out: pinned memory is, an accuracy of 0 is a result).
PLOTS = {
    "report_loss.png": ("Loss", "loss", "loss", False),
    "report_accuracy.png": ("Accuracy", "accuracy", "accuracy", False),
    "report_throughput.png": ("Throughput", "tokens/s", "tokens_per_s", True),
    "report_memory.png": ("Memory", "GiB", "_gib", True),
}
# Drawn only when the run logged them (the others say "not measured in this run" instead).
ONLY_WHEN_LOGGED = {"report_accuracy.png"}


def run_records(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: give the output_dir of a training run")
    records = read_records(path)
    if not records:
        raise SystemExit(f"{path} has no steps yet: nothing to plot")
    return records


def series(records: list[dict], name: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[name]) for r in records if r.get(name) is not None]
    return [s for s, _ in points], [v for _, v in points]


def logged_series(records: list[dict], suffix: str, drop_zeros: bool) -> dict[str, tuple[list[int], list[float]]]:
    """Every metric ending in `suffix` that was logged (with a value other than zero, if `drop_zeros`)."""
    names = sorted({name for record in records for name in record if name.endswith(suffix)})
    drawn = {name: series(records, name) for name in names}
    return {name: (steps, values) for name, (steps, values) in drawn.items()
            if values and (any(values) or not drop_zeros)}


def figure(run_dir: Path, title: str, ylabel: str, lines: dict) -> plt.Figure:
    drawing, axes = plt.subplots(figsize=(8, 4.5))
    for name, (steps, values) in lines.items():
        axes.plot(steps, values, label=name, linewidth=1)
    axes.set(title=f"{title}: {run_dir.resolve()}", xlabel="step", ylabel=ylabel)
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend()
    else:
        axes.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=axes.transAxes)
    return drawing


def figures(records: list[dict], run_dir: Path) -> dict[str, plt.Figure]:
    """PNG name -> figure, in PLOTS order."""
    drawn = {}
    for file_name, (title, ylabel, suffix, drop_zeros) in PLOTS.items():
        lines = logged_series(records, suffix, drop_zeros)
        if lines or file_name not in ONLY_WHEN_LOGGED:
            drawn[file_name] = figure(run_dir, title, ylabel, lines)
    return drawn


def summary(records: list[dict]) -> str:
    last = records[-1]
    _, speeds = series(records, "tokens_per_s")
    _, peaks = series(records, "gpu_peak_gib")
    parts = [f"{len(records)} steps recorded, last step {last['step']}", f"final loss {last.get('loss')}",
             f"final accuracy {last['accuracy']}" if last.get("accuracy") is not None else "",
             f"median tokens/s {sorted(speeds)[len(speeds) // 2]:.0f}" if speeds else "",
             f"max GPU peak {max(peaks):.2f} GiB" if peaks else "", f"skipped steps {last.get('skipped_steps', 0)}"]
    return ", ".join(p for p in parts if p)


def report(run_dir: Path) -> list[Path]:
    records = run_records(run_dir)
    paths = []
    for file_name, drawing in figures(records, run_dir).items():
        paths.append(run_dir / file_name)
        drawing.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(drawing)
    print(summary(records))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    for path in report(parser.parse_args().run_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
