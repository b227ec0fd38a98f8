"""The metrics record (metrics.jsonl, extra sources, MFU) and the PNG report drawn from it."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.jobs_support import REPO, job_config, records, single_torch_thread  # noqa: F401
from scripts.report import report
from trainer.console import step_line
from trainer.loop import train
from trainer.metrics import MetricsLog, model_flops_utilization, step_flops


def test_flops_and_mfu():
    # 6·N·T + 6·L·d·T² per sequence.
    assert step_flops(n_params=10, n_layers=2, hidden_size=4, seq_len=3, sequences=2) == 2 * (180 + 432)
    assert model_flops_utilization(795e12, 1.0, torch.device("cuda"), peak_tflops=795.0) == 1.0
    assert model_flops_utilization(795e12, 1.0, torch.device("cpu"), peak_tflops=795.0) is None


def test_metrics_log_adds_sources_writes_strict_json_and_forgets_lost_steps(tmp_path):
    log = MetricsLog(tmp_path, resumed_step=0)
    log.add_source(lambda: {"offload/pinned_gib": 1.5})
    for step in (1, 2, 3):
        record = log.write(step, {"loss": float("nan") if step == 2 else 1.0 / step})
    assert record["offload/pinned_gib"] == 1.5
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1], parse_constant=lambda name: math.nan)["loss"] is None   # no bare NaN

    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"step": 4, "lo')        # the process was killed mid-line
    MetricsLog(tmp_path, resumed_step=2)      # resumed from a step-2 checkpoint: step 3 is redone
    assert [r["step"] for r in records(tmp_path)] == [1, 2]


def test_training_records_every_step_and_report_draws_pngs(tmp_path):
    final = train(job_config(tmp_path, "max_steps=3"))
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s", "host_rss_gib",
                 "tokens_seen", "skipped_steps"):
        assert steps[-1][name] is not None, name
    assert steps[-1]["mfu"] is None                    # CPU
    assert final["loss"] == steps[-1]["loss"]
    assert step_line(final, 3).startswith("step 3/3 loss ")

    done = subprocess.run([sys.executable, "scripts/report.py", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, check=True)
    assert "3 steps recorded" in done.stdout
    for name in ("report_loss.png", "report_throughput.png", "report_memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_on_a_directory_without_metrics_says_what_to_give(tmp_path):
    with pytest.raises(SystemExit, match="give the output_dir of a training run"):
        report(tmp_path)
