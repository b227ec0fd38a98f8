"""CPU demo of evaluation by position: a tiny model trained on the recall task at 256 tokens, then fine-tuned
at 1024, past the context it was trained at. Held-out loss by position shows the positions beyond 256, never
seen in the first training, start far worse than the near ones and fall as the fine-tuning goes on.

    .venv/bin/python scripts/eval_context_demo.py [--work DIR] [--png docs/eval_context_extension.png]

A few minutes on one CPU core. Writes the PNG (one curve per evaluation) and prints each evaluation's figures.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from hydra import compose, initialize_config_dir

from conf.schema import register_configs
from scripts.export import export
from scripts.report import loss_by_position_figure, position_curve
from trainer.loop import train
from trainer.metrics import METRICS_FILE, read_records

REPO = Path(__file__).resolve().parents[1]
TASK = ["data.num_pairs=8", "data.repeats=4", "data.num_queries=8", "device=cpu", "logger.wandb.mode=disabled",
        "logger.progress_bar=false", "checkpoint.every_minutes=0", "log_every=50"]
SHORT, LONG = 256, 1024


def job(output_dir: Path, *overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=[*TASK, f"output_dir={output_dir}", *overrides])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=None, help="directory for the two runs (default: a temporary one)")
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "eval_context_extension.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = args.work or Path(tempfile.mkdtemp(prefix="eval_context_demo_"))
    short = work / f"train_{SHORT}"
    train(job(short, f"seq_len={SHORT}", "batch_size=8", "max_steps=300", "optim.lr=1e-3",
              f"model.max_position_embeddings={SHORT}", "checkpoint.every_steps=300"))
    base = export(short / "checkpoints" / "step-300", work / f"model_{SHORT}")
    long = work / f"extend_{LONG}"
    train(job(long, f"model.path={base}", f"seq_len={LONG}", "batch_size=2", "max_steps=400", "optim.lr=1e-3",
              "optim.warmup_steps=20", "eval.every_steps=80", "eval.sequences=16", "checkpoint.every_steps=0"))
    evaluations = [record for record in read_records(long / METRICS_FILE) if "eval/loss" in record]
    for record in evaluations:
        print({name: round(value, 3) for name, value in record.items() if name.startswith("eval/")})
    curves = {f"step {record['step']}": position_curve(record) for record in evaluations}
    drawing = loss_by_position_figure(f"Recall model trained at {SHORT} tokens, fine-tuned at {LONG}: held-out loss",
                                      curves)
    drawing.axes[0].axvline(SHORT, color="grey", linestyle=":", linewidth=1)
    drawing.savefig(args.png, dpi=110, bbox_inches="tight")
    plt.close(drawing)
    print(f"wrote {args.png} (runs in {work})")


if __name__ == "__main__":
    main()
