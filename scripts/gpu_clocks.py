"""The GPU's SM clock and power draw while a benchmark times something: nvidia-smi sampled every few
milliseconds by a thread, so that a table can say at what clock each cell was measured. The H100 lowers its
clock under sustained power: on 2026-11-25 the same cuDNN kernel on the same inputs took 1-4% longer right
after our forward than after cuDNN's, and cells of one run spread by up to 17% (docs/BENCHMARKS.md). The
clock is read as it is; power.draw is the driver's own average (over up to a second on some GPUs), so a
short cell's watts include its neighbours'. The energy counter (total_energy_consumption, mJ since the driver
loaded) has no such lag: the energy a window used over its duration is its exact mean power, and a kernel's
TFLOP/s over those watts is its work per joule, what decides its speed once the GPU runs at its power limit
(at 32k every attention forward+backward measured did, 2026-11-25).

    with ClockSampler() as clocks:
        start = time.monotonic(); run(); end = time.monotonic()
    clocks.during([(start, end)])     # (mean SM MHz, mean W, samples, W by the energy counter) or None
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

QUERY = ("nvidia-smi", "--query-gpu=clocks.sm,power.draw,total_energy_consumption", "--format=csv,noheader,nounits")


def available() -> bool:
    return shutil.which(QUERY[0]) is not None


def parse_sample(line: str) -> tuple[float, float, float | None] | None:
    """(SM MHz, W, mJ or None where the GPU has no energy counter) from one line of QUERY's output; None for
    anything else ("[N/A]" clocks, a header, a message)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 3:
        return None
    try:
        mhz, watts = float(fields[0]), float(fields[1])
    except ValueError:
        return None
    try:
        return mhz, watts, float(fields[2])
    except ValueError:
        return mhz, watts, None


class ClockSampler:
    """Samples (time.monotonic(), SM MHz, W, mJ or None) from `command` (by default nvidia-smi, every interval_ms, on
    one GPU) while the `with` block runs."""

    def __init__(self, gpu: str = "0", interval_ms: int = 20, command: list[str] | None = None):
        """gpu: as nvidia-smi's --id takes it (an index, a UUID, a PCI bus id)."""
        self.command = command or [*QUERY, f"--id={gpu}", f"--loop-ms={interval_ms}"]
        self.samples: list[tuple[float, float, float, float | None]] = []
        self._process = self._reader = None

    def __enter__(self) -> "ClockSampler":
        self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        self._process.terminate()
        self._process.wait()
        self._reader.join()

    def _read(self) -> None:
        for line in self._process.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append((time.monotonic(), *sample))

    def during(self, windows: list[tuple[float, float]]) -> tuple[float, float, int, float | None] | None:
        """Mean SM MHz and W of the samples taken inside any of the (start, end) windows, their count, and the
        mean W by the energy counter: the energy between each window's first and last sample over the time
        between them, summed over the windows (None without two counted samples in some window). None when
        no sample lies inside (nvidia-smi missing or slower than the windows)."""
        inside = [[sample for sample in self.samples if start <= sample[0] <= end] for start, end in windows]
        samples = [sample for window in inside for sample in window]
        if not samples:
            return None
        return (statistics.fmean(mhz for _, mhz, _, _ in samples), statistics.fmean(w for _, _, w, _ in samples),
                len(samples), _energy_watts(inside))


def _energy_watts(windows: list[list[tuple]]) -> float | None:
    joules = seconds = 0.0
    for window in windows:
        counted = [(when, millijoules) for when, _, _, millijoules in window if millijoules is not None]
        if len(counted) < 2:
            return None
        joules += (counted[-1][1] - counted[0][1]) / 1000
        seconds += counted[-1][0] - counted[0][0]
    return joules / seconds if seconds > 0 else None
