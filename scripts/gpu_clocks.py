"""The GPU's SM clock and power while a benchmark times something: NVML (the driver's libnvidia-ml, called
through ctypes) read every few milliseconds by a thread, so that a table can say at what clock each cell was
measured. The H100 lowers its clock at its 700 W power limit, so a kernel's time moves with the clock and the
power of what ran before it (docs/PERFORMANCE.md, "How to measure"). The clock is read as it is; the power
(nvmlDeviceGetPowerUsage, nvidia-smi's power.draw) is the driver's own average (over up to a second on some
GPUs), so a short cell's watts include its neighbours'. The energy counter
(nvmlDeviceGetTotalEnergyConsumption, mJ since the driver loaded) has no such lag: the energy a window used
over its duration is its exact mean power, and a kernel's TFLOP/s over those watts is its work per joule, what
decides its speed once the GPU runs at its power limit (as every attention forward+backward measured from 32k
does).

NVML rather than nvidia-smi --loop-ms, whose output read with its errors discarded gave the H100 a table
without a single sample and no reason (most likely a query field it refused). Here a failing NVML call raises,
naming itself and its return code.

    with ClockSampler() as clocks:
        start = time.monotonic(); run(); end = time.monotonic()
    clocks.during([(start, end)])     # (mean SM MHz, mean W, samples, W by the energy counter) or None
"""
from __future__ import annotations

import contextlib
import ctypes
import statistics
import threading
import time
from collections.abc import Callable, Iterator

LIBRARY = "libnvidia-ml.so.1"    # NVML, installed with the NVIDIA driver (no pip package needed)
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3     # the energy counter's answer on GPUs without one (before Volta)
NVML_CLOCK_SM = 1

Reading = tuple[float, float, float | None]    # SM MHz, W, mJ since the driver loaded (None: no counter)


def available() -> bool:
    """Whether NVML loads here; whether it initialises and reads the GPU, ClockSampler finds out, loudly."""
    try:
        _load(LIBRARY)
    except RuntimeError:
        return False
    return True


def _load(library: str) -> ctypes.CDLL:
    try:
        nvml = ctypes.CDLL(library)
    except OSError as error:
        raise RuntimeError(f"cannot load {library} (NVML, installed with the NVIDIA driver): {error}") from error
    nvml.nvmlErrorString.restype = ctypes.c_char_p
    return nvml


@contextlib.contextmanager
def nvml_reader(gpu: str = "0", library: str = LIBRARY) -> Iterator[Callable[[], Reading]]:
    """A function reading one GPU's (SM MHz, W, mJ or None), NVML initialised while the block runs. gpu: an NVML
    index (the driver's numbering, which CUDA_VISIBLE_DEVICES does not change), a UUID ("GPU-…" or "MIG-…") or
    a PCI bus id ("00000000:65:00.0"). Every failing call raises a RuntimeError naming it and its code."""
    nvml = _load(library)

    def check(function: str, code: int) -> None:
        if code != NVML_SUCCESS:
            raise RuntimeError(f"NVML's {function} returned {code} ({nvml.nvmlErrorString(code).decode()}) "
                               f"for GPU {gpu!r}")

    def call(function: str, *args) -> None:
        check(function, getattr(nvml, function)(*args))

    def read() -> Reading:
        mhz, milliwatts, millijoules = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        call("nvmlDeviceGetClockInfo", device, NVML_CLOCK_SM, ctypes.byref(mhz))
        call("nvmlDeviceGetPowerUsage", device, ctypes.byref(milliwatts))
        code = nvml.nvmlDeviceGetTotalEnergyConsumption(device, ctypes.byref(millijoules))
        counted = code != NVML_ERROR_NOT_SUPPORTED
        if counted:
            check("nvmlDeviceGetTotalEnergyConsumption", code)
        return float(mhz.value), milliwatts.value / 1000, float(millijoules.value) if counted else None

    call("nvmlInit_v2")
    try:
        device = _device_handle(call, gpu)
        yield read
    finally:
        nvml.nvmlShutdown()    # unchecked: the samples are taken, and raising here would hide the block's error


def _device_handle(call: Callable, gpu: str) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    if gpu.isdigit():
        call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(int(gpu)), ctypes.byref(handle))
    elif gpu.startswith(("GPU-", "MIG-")):
        call("nvmlDeviceGetHandleByUUID", gpu.encode(), ctypes.byref(handle))
    else:
        call("nvmlDeviceGetHandleByPciBusId_v2", gpu.encode(), ctypes.byref(handle))
    return handle


class ClockSampler:
    """Samples (time.monotonic(), SM MHz, W, mJ or None) of one GPU while the `with` block runs: the first on
    entering, which raises where NVML fails, then one every interval_ms (plus the read's own time) from a
    thread. A read failing later ends the thread with its traceback on stderr; the windows after it then
    hold no samples."""

    def __init__(self, gpu: str = "0", interval_ms: int = 20, reader: Callable[[], Reading] | None = None):
        """gpu: as nvml_reader takes it (an index, a UUID, a PCI bus id). reader: what reads a sample, by default
        NVML on that GPU (a stand-in for tests)."""
        self.gpu, self.interval_s, self.reader = gpu, interval_ms / 1000, reader
        self.samples: list[tuple[float, float, float, float | None]] = []
        self._stop = self._thread = self._opened = None

    def __enter__(self) -> "ClockSampler":
        with contextlib.ExitStack() as opened:
            read = self.reader or opened.enter_context(nvml_reader(self.gpu))
            self._sample(read)    # here, not in the thread, so that a failing read raises to the caller
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample_until_stopped, args=(read,), daemon=True)
            self._thread.start()
            self._opened = opened.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._opened.close()

    def _sample_until_stopped(self, read: Callable[[], Reading]) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample(read)

    def _sample(self, read: Callable[[], Reading]) -> None:
        reading = read()
        self.samples.append((time.monotonic(), *reading))

    def during(self, windows: list[tuple[float, float]]) -> tuple[float, float, int, float | None] | None:
        """Mean SM MHz and W of the samples taken inside any of the (start, end) windows, their count, and the
        mean W by the energy counter: the energy between each window's first and last sample over the time
        between them, summed over the windows (None without two counted samples in some window). None when
        no sample lies inside (the windows shorter than the interval, or the sampling stopped)."""
        inside = [[sample for sample in self.samples if start <= sample[0] <= end] for start, end in windows]
        samples = [sample for window in inside for sample in window]
        if not samples:
            return None
        return (statistics.fmean(mhz for _, mhz, _, _ in samples), statistics.fmean(w for _, _, w, _ in samples),
                len(samples), _energy_watts(inside))


def current_gpu() -> str:
    """This process's CUDA device as NVML takes it: its UUID (CUDA_VISIBLE_DEVICES may renumber the GPUs, and
    NVML's numbering ignores it)."""
    import torch      # only here: the sampler itself needs NVML alone
    return f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"


def describe(clock: tuple | None, tflops: float) -> str:
    """" @ MHz W TFLOP/J" for what ClockSampler.during returned over work done at `tflops` (the watts and the
    work per joule by the energy counter; where the GPU has none, the power reading's watts alone), or what
    happened when nothing was sampled."""
    if not clock:
        return " @ no clock samples"
    mhz, power_watts, _, energy_watts = clock
    if energy_watts is None:
        return f" @ {mhz:.0f} MHz {power_watts:.0f} W (power reading, no energy counter)"
    return f" @ {mhz:.0f} MHz {energy_watts:.0f} W {tflops / energy_watts:.3f} TFLOP/J"


def _energy_watts(windows: list[list[tuple]]) -> float | None:
    joules = seconds = 0.0
    for window in windows:
        counted = [(when, millijoules) for when, _, _, millijoules in window if millijoules is not None]
        if len(counted) < 2:
            return None
        joules += (counted[-1][1] - counted[0][1]) / 1000
        seconds += counted[-1][0] - counted[0][0]
    return joules / seconds if seconds > 0 else None
