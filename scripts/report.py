"""Plot a run's metrics.jsonl (no W&B needed) into PNGs in the run directory.

    .venv/bin/python scripts/report.py <run dir>

Writes report_loss.png, report_accuracy.png (when the run logged accuracy), report_throughput.png and
report_memory.png, each titled with the run directory, and prints a one-paragraph summary. A metric that is
zero throughout (e.g. pinned memory on a run that offloads nothing) is left out of its plot. A run that
evaluated (eval.every_steps) also gets report_loss_by_position.png (held-out loss against token position,
log scale, one curve per evaluation) and, with passkey figures, report_passkey.png (accuracy by haystack
length and key depth: the first and the last probe).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from trainer.metrics import METRICS_FILE, read_records
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
# trainer.evaluate's keys: loss of positions [from, to), passkey accuracy per haystack length and key depth (%).
POSITION_KEY = re.compile(r"eval/loss_pos/(\d+)-(\d+)$")
PASSKEY_KEY = re.compile(r"eval/passkey/(\d+)/(\d+)$")


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


def position_curve(record: dict) -> tuple[list[int], list[float]]:
    """(bucket end, loss) of an evaluation's loss by position, in position order."""
    points = sorted((int(match[2]), value) for name, value in record.items()
                    if (match := POSITION_KEY.match(name)) and value is not None)
    return [end for end, _ in points], [value for _, value in points]


def loss_by_position_figure(title: str, curves: dict[str, tuple[list[int], list[float]]]) -> plt.Figure:
    """Loss against position (log scale), one curve per label (an evaluation's step), later ones darker."""
    drawing, axes = plt.subplots(figsize=(8, 4.5))
    colors = plt.get_cmap("viridis_r")
    for index, (label, (ends, losses)) in enumerate(curves.items()):
        axes.plot(ends, losses, marker="o", markersize=3, linewidth=1, label=label,
                  color=colors(0.15 + 0.85 * index / max(len(curves) - 1, 1)))
    axes.set_xscale("log", base=2)
    axes.set(title=title, xlabel="token position in its document (end of bucket)", ylabel="held-out loss")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncol=2)
    return drawing


def passkey_cells(record: dict) -> tuple[list[int], list[int], list[list[float]]]:
    """(lengths, depths in %, accuracy[length][depth]) of an evaluation's passkey probe."""
    cells = {(int(match[1]), int(match[2])): value for name, value in record.items()
             if (match := PASSKEY_KEY.match(name))}
    lengths, depths = sorted({length for length, _ in cells}), sorted({depth for _, depth in cells})
    return lengths, depths, [[cells.get((length, depth), float("nan")) for depth in depths] for length in lengths]


def passkey_figure(title: str, grids: dict[str, tuple[list[int], list[int], list[list[float]]]]) -> plt.Figure:
    """One length x depth heatmap of passkey accuracy per label (an evaluation's step)."""
    drawing, panels = plt.subplots(1, len(grids), figsize=(4.5 * len(grids) + 1, 4), squeeze=False)
    for axes, (label, (lengths, depths, accuracy)) in zip(panels[0], grids.items()):
        image = axes.imshow(accuracy, vmin=0, vmax=1, cmap="RdYlGn", origin="lower", aspect="auto")
        axes.set_xticks(range(len(depths)), [f"{depth}%" for depth in depths])
        axes.set_yticks(range(len(lengths)), [f"{length:,}" for length in lengths])
        axes.set(title=label, xlabel="depth of the key", ylabel="haystack tokens")
    drawing.colorbar(image, ax=panels[0].tolist(), label="exact-match accuracy")
    drawing.suptitle(title)
    return drawing


def evaluation_figures(records: list[dict], run_dir: Path) -> dict[str, plt.Figure]:
    """The loss by position of every evaluation and the first and last passkey heatmaps, where logged."""
    drawn = {}
    curves = {f"step {r['step']}": position_curve(r) for r in records if position_curve(r)[0]}
    if curves:
        title = f"Held-out loss by position: {run_dir.resolve()}"
        drawn["report_loss_by_position.png"] = loss_by_position_figure(title, curves)
    probed = [r for r in records if passkey_cells(r)[0]]
    if probed:
        chosen = {f"step {r['step']}": passkey_cells(r) for r in (probed[0], probed[-1])}
        drawn["report_passkey.png"] = passkey_figure(f"Passkey retrieval: {run_dir.resolve()}", chosen)
    return drawn


def figures(records: list[dict], run_dir: Path) -> dict[str, plt.Figure]:
    """PNG name -> figure, in PLOTS order, then the evaluation's."""
    drawn = {}
    for file_name, (title, ylabel, suffix, drop_zeros) in PLOTS.items():
        lines = logged_series(records, suffix, drop_zeros)
        if lines or file_name not in ONLY_WHEN_LOGGED:
            drawn[file_name] = figure(run_dir, title, ylabel, lines)
    return drawn | evaluation_figures(records, run_dir)


def summary(records: list[dict]) -> str:
    records = [record for record in records if "loss" in record] or records     # not an evaluation before step 1
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
