"""The GPU's SM clock and power draw while a benchmark times something: nvidia-smi sampled every few
milliseconds by a thread, so that a table can say at what clock each cell was measured. The H100 lowers its
clock under sustained power: on 2026-11-25 the same cuDNN kernel on the same inputs took 1-4% longer right
after our forward than after cuDNN's, and cells of one run spread by up to 17% (docs/BENCHMARKS.md). The
clock is read as it is; power.draw is the driver's own average (over up to a second on some GPUs), so a
short cell's watts include its neighbours'.

    with ClockSampler() as clocks:
        start = time.monotonic(); run(); end = time.monotonic()
    clocks.during([(start, end)])     # (mean SM MHz, mean W, samples) or None
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

QUERY = ("nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits")


def available() -> bool:
    return shutil.which(QUERY[0]) is not None


def parse_sample(line: str) -> tuple[float, float] | None:
    """(SM MHz, W) from one line of QUERY's output, None for anything else ("[N/A]", a header, a message)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 2:
        return None
    try:
        return float(fields[0]), float(fields[1])
    except ValueError:
        return None


class ClockSampler:
    """Samples (time.monotonic(), SM MHz, W) from `command` (by default nvidia-smi, every interval_ms, on
    one GPU) while the `with` block runs."""

    def __init__(self, gpu: str = "0", interval_ms: int = 20, command: list[str] | None = None):
        """gpu: as nvidia-smi's --id takes it (an index, a UUID, a PCI bus id)."""
        self.command = command or [*QUERY, f"--id={gpu}", f"--loop-ms={interval_ms}"]
        self.samples: list[tuple[float, float, float]] = []
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

    def during(self, windows: list[tuple[float, float]]) -> tuple[float, float, int] | None:
        """Mean SM MHz and W of the samples taken inside any of the (start, end) windows, and their count;
        None when there is none (nvidia-smi missing or slower than the windows)."""
        inside = [(mhz, watts) for when, mhz, watts in self.samples
                  if any(start <= when <= end for start, end in windows)]
        if not inside:
            return None
        return statistics.fmean(m for m, _ in inside), statistics.fmean(w for _, w in inside), len(inside)
