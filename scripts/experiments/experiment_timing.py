"""The experiments' timer: callables timed in turn, round after round, on the GPU (its clock drifts with
temperature and power: docs/PERFORMANCE.md, "How to measure"), each one's median
printed with its spread (max - min, in % of the median), and with a scripts.gpu_clocks.ClockSampler its clock,
mean power and work per joule."""
from __future__ import annotations

import math
import statistics
import time

import torch

from scripts import gpu_clocks

# NVML's energy counter moves in steps too coarse for shorter timings (docs/PERFORMANCE.md, "How to measure").
METERED_MS = 1000


def milliseconds(call, reps: int) -> float:
    """GPU time of one call of `call` (no arguments): `reps` calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def time_in_turn(label: str, calls: dict, flops: float, rounds: int, reps: int, sampler=None) -> None:
    """calls: {name: a function of no arguments}, each timed `reps` calls at a time (`milliseconds`); under a
    running gpu_clocks.ClockSampler, enough calls at a time for METERED_MS, and their energy reported."""
    if sampler is not None:
        reps = max(reps, *(math.ceil(METERED_MS / milliseconds(call, 1)) for call in calls.values()))
    times = {name: [] for name in calls}
    windows = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.monotonic()
            times[name].append(milliseconds(call, reps))
            windows[name].append((start, time.monotonic()))
    for name, runs in times.items():
        ms = statistics.median(runs)
        tflops = flops / ms / 1e9
        meter = gpu_clocks.describe(sampler.during(windows[name]), tflops) if sampler is not None else ""
        print(f"{label:20s} {name:14s} {ms:8.3f} ms {tflops:5.0f} TFLOP/s"
              f"  spread {100 * (max(runs) - min(runs)) / ms:.1f}%{meter}", flush=True)
