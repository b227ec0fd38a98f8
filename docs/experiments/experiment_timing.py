"""The experiments' timer: callables timed in turn, round after round, on the GPU (its clock drifts with
temperature and power: timed one after another, the same kernel once ranked 11% apart), each one's median
printed with its spread (max - min, in % of the median)."""
from __future__ import annotations

import statistics

import torch


def milliseconds(call, reps: int) -> float:
    """GPU time of one call of `call` (no arguments): `reps` calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def time_in_turn(label: str, calls: dict, flops: float, rounds: int, reps: int) -> None:
    """calls: {name: a function of no arguments}, each timed `reps` calls at a time (`milliseconds`)."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(milliseconds(call, reps))
    for name, runs in times.items():
        ms = statistics.median(runs)
        print(f"{label:20s} {name:14s} {ms:8.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s"
              f"  spread {100 * (max(runs) - min(runs)) / ms:.1f}%", flush=True)
