"""scripts/gpu_clocks.py on the CPU: the sampler's thread fed by a stand-in reader, and NVML's calls answered by a
stand-in library (its units, its handles, its errors)."""
import ctypes
import itertools
import re
import time

import pytest

from scripts import gpu_clocks
from scripts.gpu_clocks import ClockSampler, nvml_reader


def _reading(i: int) -> tuple[float, float, float]:
    """The i-th stand-in reading: the clock, the power and the energy counter (1,000 mJ a reading) rising."""
    return 1500.0 + 10 * i, 300.5 + i, 5000.0 + 1000 * i


def _sample_until(clocks: ClockSampler, count: int, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while len(clocks.samples) < count:
        assert time.monotonic() < deadline, f"the sampler took {len(clocks.samples)} samples, not {count}"
        time.sleep(0.01)


def test_a_sampler_averages_the_samples_inside_the_windows():
    readings = map(_reading, itertools.count())
    with ClockSampler(interval_ms=5, reader=lambda: next(readings)) as clocks:
        _sample_until(clocks, 5)
    times = [when for when, *_ in clocks.samples]
    assert [sample[1:] for sample in clocks.samples] == [_reading(i) for i in range(len(clocks.samples))]
    assert min(later - earlier for earlier, later in itertools.pairwise(times)) >= 0.004    # interval_ms apart
    mhz, watts, count, energy_watts = clocks.during([(times[0], times[4])])
    assert (mhz, watts, count) == (1520.0, 302.5, 5)
    assert energy_watts == pytest.approx(4.0 / (times[4] - times[0]))    # 4 J over the samples' span
    # two windows of two samples each: the energy of both over both spans
    mhz, watts, count, energy_watts = clocks.during([(times[0], times[1]), (times[3], times[4])])
    assert (mhz, watts, count) == (1520.0, 302.5, 4)
    assert energy_watts == pytest.approx(2.0 / (times[1] - times[0] + times[4] - times[3]))
    # a window around one sample: the clock, but no energy rate
    assert clocks.during([(times[2], times[2])]) == (1520.0, 302.5, 1, None)
    assert clocks.during([(times[0], times[1]), (times[2], times[2])])[3] is None    # so in one of two windows
    assert clocks.during([(times[-1] + 1.0, times[-1] + 2.0)]) is None


def test_a_gpu_without_an_energy_counter_has_watts_but_no_energy_rate():
    with ClockSampler(interval_ms=5, reader=lambda: (1755.0, 699.9, None)) as clocks:
        _sample_until(clocks, 3)
    times = [when for when, *_ in clocks.samples]
    assert clocks.during([(times[0], times[-1])]) == (1755.0, 699.9, len(times), None)


def test_a_failing_first_read_raises_on_entering():
    def failing():
        raise RuntimeError("NVML's nvmlDeviceGetClockInfo returned 15 (GPU is lost)")

    sampler = ClockSampler(reader=failing)
    with pytest.raises(RuntimeError, match="nvmlDeviceGetClockInfo returned 15"):
        with sampler:
            pytest.fail("the block ran without a sample")
    assert sampler.samples == [] and sampler._thread is None


class FakeNvml:
    """libnvidia-ml answered in Python: a GPU at 1980 MHz drawing 296,490 mW whose counter reads 81,234,567 mJ;
    the calls named in `codes` return those codes instead. Each call is recorded with its first argument."""

    VALUES = {"nvmlDeviceGetClockInfo": 1980, "nvmlDeviceGetPowerUsage": 296490,
              "nvmlDeviceGetTotalEnergyConsumption": 81234567}

    def __init__(self, **codes: int):
        self.codes, self.calls = codes, []
        self.nvmlErrorString = lambda code: {3: b"Not Supported", 9: b"Driver Not Loaded"}.get(code, b"Unknown Error")

    def __getattr__(self, function: str):
        def answer(*args):
            self.calls.append((function, args[0] if args else None))
            if function in self.VALUES and function not in self.codes:
                args[-1]._obj.value = self.VALUES[function]    # what NVML writes through the pointer
            return self.codes.get(function, gpu_clocks.NVML_SUCCESS)
        return answer


def _install(monkeypatch, library: FakeNvml) -> FakeNvml:
    monkeypatch.setattr(ctypes, "CDLL", lambda name: library)
    return library


def test_nvml_readings_are_in_mhz_watts_and_millijoules(monkeypatch):
    nvml = _install(monkeypatch, FakeNvml())
    with nvml_reader("0") as read:
        assert read() == (1980.0, 296.49, 81234567.0)
    assert [function for function, _ in nvml.calls] == [
        "nvmlInit_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetClockInfo", "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEnergyConsumption", "nvmlShutdown"]


def test_an_unsupported_energy_counter_reads_as_none(monkeypatch):
    _install(monkeypatch, FakeNvml(nvmlDeviceGetTotalEnergyConsumption=gpu_clocks.NVML_ERROR_NOT_SUPPORTED))
    with nvml_reader("0") as read:
        assert read() == (1980.0, 296.49, None)


@pytest.mark.parametrize("gpu,function,key", [
    ("1", "nvmlDeviceGetHandleByIndex_v2", 1),
    ("GPU-8f6e0a4c-1b2d-4e3f", "nvmlDeviceGetHandleByUUID", b"GPU-8f6e0a4c-1b2d-4e3f"),
    ("00000000:65:00.0", "nvmlDeviceGetHandleByPciBusId_v2", b"00000000:65:00.0"),
])
def test_the_gpu_is_found_by_index_uuid_or_pci_bus_id(monkeypatch, gpu, function, key):
    nvml = _install(monkeypatch, FakeNvml())
    with nvml_reader(gpu):
        pass
    name, first = nvml.calls[1]
    assert name == function
    assert (first.value if isinstance(first, ctypes.c_uint) else first) == key


@pytest.mark.parametrize("function,code,message", [
    ("nvmlInit_v2", 9, "nvmlInit_v2 returned 9 (Driver Not Loaded)"),
    ("nvmlDeviceGetHandleByUUID", 999, "nvmlDeviceGetHandleByUUID returned 999 (Unknown Error) for GPU 'GPU-0'"),
    ("nvmlDeviceGetPowerUsage", 999, "nvmlDeviceGetPowerUsage returned 999"),
    ("nvmlDeviceGetTotalEnergyConsumption", 999, "nvmlDeviceGetTotalEnergyConsumption returned 999"),
])
def test_a_failing_nvml_call_raises_naming_it_and_its_code(monkeypatch, function, code, message):
    nvml = _install(monkeypatch, FakeNvml(**{function: code}))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        with ClockSampler("GPU-0"):
            pytest.fail("the block ran without a sample")
    # NVML shut down again wherever it had initialised
    assert (nvml.calls[-1][0] == "nvmlShutdown") == (function != "nvmlInit_v2")


def test_a_missing_library_raises_naming_it():
    with pytest.raises(RuntimeError, match="cannot load libnvidia-ml-missing.so.1"):
        with nvml_reader("0", library="libnvidia-ml-missing.so.1"):
            pytest.fail("NVML opened without its library")


def test_without_nvml_nothing_is_available_and_a_sampler_raises(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert not gpu_clocks.available()
    with pytest.raises(RuntimeError, match=f"cannot load {gpu_clocks.LIBRARY}"):
        with ClockSampler():
            pytest.fail("the block ran without NVML")


def test_with_nvml_loading_it_is_available(monkeypatch):
    _install(monkeypatch, FakeNvml())
    assert gpu_clocks.available()


def test_describe_gives_the_energy_counters_watts_and_work_per_joule_or_says_what_is_missing():
    assert gpu_clocks.describe((1500.0, 650.0, 40, 700.0), 560.0) == " @ 1500 MHz 700 W 0.800 TFLOP/J"
    assert gpu_clocks.describe((1500.0, 650.0, 40, None), 560.0) == (
        " @ 1500 MHz 650 W (power reading, no energy counter)")
    assert gpu_clocks.describe(None, 560.0) == " @ no clock samples"
