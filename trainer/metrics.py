"""Per-step measurements (throughput, MFU, memory) and the metrics record.

Every step's metrics go to <run dir>/metrics.jsonl (one JSON object per line, readable without W&B; see
scripts/report.py) and to W&B. Other subsystems add their own per-step numbers with
`MetricsLog.add_source(fn)`, where `fn()` returns a dict of name -> number (for example the memory engine's
pinned bytes and copy bandwidth); a name with a slash ("offload/pinned_gib") picks its W&B section.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import psutil
import torch

from offload.units import GIB
from storage.atomic import atomic_write_text

METRICS_FILE = "metrics.jsonl"
MetricSource = Callable[[], dict]


def step_flops(n_params: int, n_layers: int, hidden_size: int, seq_len: int, sequences: int) -> float:
    """Training FLOPs of one step: 6·N·T for the weights plus 6·L·d·T² for causal attention, per sequence."""
    return sequences * (6 * n_params * seq_len + 6 * n_layers * hidden_size * seq_len ** 2)


def model_flops_utilization(flops: float, seconds: float, device: torch.device, peak_tflops: float) -> float | None:
    """Achieved / peak FLOP rate; None on CPU, where no meaningful peak is configured."""
    if device.type != "cuda" or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)


def wait_for_device(device: torch.device) -> None:
    """Let queued GPU work (the optimizer step) finish, so the step time covers all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak-memory window."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_metrics(device: torch.device) -> dict:
    """Host RSS, and on CUDA the allocated / reserved / peak-this-step GPU memory, in GiB."""
    metrics = {"host_rss_gib": psutil.Process().memory_info().rss / GIB}
    if device.type == "cuda":
        metrics.update(gpu_allocated_gib=torch.cuda.memory_allocated(device) / GIB,
                       gpu_reserved_gib=torch.cuda.memory_reserved(device) / GIB,
                       gpu_peak_gib=torch.cuda.max_memory_allocated(device) / GIB)
    return metrics


def finite_or_none(value):
    """JSON has no NaN/Inf: non-finite numbers are recorded as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a last line cut short by a killed process is ignored."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def drop_records_after(path: Path, step: int) -> None:
    """Forget records of steps after `step` (and any cut-off line): that work was lost and is about to be
    redone."""
    if path.is_file():
        kept = [record for record in read_records(path) if record["step"] <= step]
        # Through a renamed copy: a full disk leaves the records as they were, not an emptied file.
        atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in kept))


class MetricsLog:
    """Writes each step's metrics, plus those of the registered sources, to metrics.jsonl and W&B."""

    def __init__(self, run_dir: Path, resumed_step: int, wandb_run=None):
        self.path = run_dir / METRICS_FILE
        drop_records_after(self.path, resumed_step)
        self.wandb_run = wandb_run
        self.sources: list[MetricSource] = []

    def add_source(self, source: MetricSource) -> None:
        self.sources.append(source)

    def write(self, step: int, metrics: dict) -> dict:
        """Record the step's metrics; returns the full record (with the sources' metrics)."""
        record = {"step": step, "time": time.time(), **metrics}
        for source in self.sources:
            record.update(source())
        record = {name: finite_or_none(value) for name, value in record.items()}
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(record, step)
        return record
