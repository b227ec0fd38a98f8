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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import torch

from model.config import DecoderConfig
from model.family import projection_shapes
from offload.byte_model import parameter_counts
from offload.units import GIB
from storage.atomic import atomic_write_text

METRICS_FILE = "metrics.jsonl"
MetricSource = Callable[[], dict]


# Dense bf16 tensor-core peaks (without sparsity) of NVIDIA's datasheets, TFLOP/s, by the memory.gpu preset
# names (conf.schema.memory.GPU_PRESETS): `mfu`'s denominator. The SXM parts: the PCIe and NVL H100 and H200 have
# lower peaks, which logger.peak_tflops gives (as it gives any other GPU's).
DATASHEET_BF16_TFLOPS = {"a100_80gb": 312.0, "h100_80gb": 989.0, "h200": 989.0}
# The dense bf16 matmul rate measured on the H100 80GB: the ceiling a step's products reach there in practice (its
# clock falls under the 700 W limit), `mfu_measured_ceiling`'s denominator. Measured on no other GPU.
MEASURED_MATMUL_TFLOPS = {"h100_80gb": 795.0}
# The words of torch's device name ("NVIDIA H100 80GB HBM3") that pick each preset's peaks; a PCIe or NVL part's
# name picks none.
DEVICE_NAME_WORDS = {"A100": "a100_80gb", "H100": "h100_80gb", "H200": "h200"}
OTHER_PEAK_WORDS = ("PCIe", "NVL")


@dataclass(frozen=True)
class FlopPeaks:
    """The two denominators of a GPU's MFU figures, TFLOP/s; None where not known (on CPU: neither)."""
    datasheet: float | None = None
    measured: float | None = None


def flop_peaks(device_name: str | None, configured: float | None = None) -> FlopPeaks:
    """The peaks of the GPU torch names `device_name` (None: the CPU, no MFU): its datasheet peak, or
    `configured` (logger.peak_tflops) where given, and its measured matmul ceiling where one was measured."""
    if device_name is None:
        return FlopPeaks()
    words = device_name.replace("-", " ").split()
    preset = None if any(word in words for word in OTHER_PEAK_WORDS) else \
        next((name for word, name in DEVICE_NAME_WORDS.items() if word in words), None)
    return FlopPeaks(configured or DATASHEET_BF16_TFLOPS.get(preset), MEASURED_MATMUL_TFLOPS.get(preset))


def step_flops(arch: DecoderConfig, train_cfg, seq_len: int, sequences: int) -> int:
    """Model FLOPs of one training step, in the convention every MFU here is stated in ("non-embedding 6N,
    causal attention at half the square"; docs/JOBS.md, "Metrics"). Per token, forward and backward:
    - 6 × N, N the weights of the products a token passes through: each layer's seven projections at their
      real widths (head_dim of its own, K and V at the KV heads' width) and the output projection, once, tied to
      the input embedding or not; not the input embedding, a lookup. A LoRA run adds its adapters' weights and
      still counts 6 for each frozen weight, whose weight gradient it does not compute: the model's FLOPs, as
      full fine-tuning counts them, not the work done (4 a frozen weight, plus recomputation).
    - 6 × layers × heads × head_dim × seq_len for attention: the forward's two products (2 FLOPs a
      multiply-add) over the causal half of the seq_len² square, the backward's four; grouped KV heads change
      none of it. Per sequence: a row of packed documents counts as one causal sequence of seq_len."""
    matrix = arch.num_hidden_layers * sum(i * o for i, o in projection_shapes(arch).values())
    matrix += arch.hidden_size * arch.vocab_size
    if train_cfg.mode == "lora":
        matrix += parameter_counts(arch, train_cfg)[1]
    attention = arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim * seq_len
    return sequences * seq_len * (6 * matrix + 6 * attention)


def mfu_metrics(flops: float, seconds: float, peaks: FlopPeaks) -> dict:
    """`mfu`: achieved FLOP/s over the datasheet peak; `mfu_measured_ceiling`: over the measured matmul ceiling.
    Each None where its peak is not known."""
    def share(tflops):
        return flops / seconds / (tflops * 1e12) if tflops and seconds > 0 else None
    return {"mfu": share(peaks.datasheet), "mfu_measured_ceiling": share(peaks.measured)}


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
