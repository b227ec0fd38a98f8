"""scripts/gpu_clocks.py on the CPU: nvidia-smi's lines parsed, and a sampler fed by a stand-in command."""
import sys
import time

import pytest

from scripts.gpu_clocks import ClockSampler, parse_sample


@pytest.mark.parametrize("line,sample", [
    ("1980, 296.49\n", (1980.0, 296.49)),
    (" 1755 ,  699.9", (1755.0, 699.9)),
    ("[N/A], [N/A]\n", None),
    ("Failed to initialize NVML: Unknown Error\n", None),
    ("1980, 296.49, 48\n", None),
])
def test_nvidia_smi_lines_are_parsed(line, sample):
    assert parse_sample(line) == sample


def _wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the stand-in sampler printed too little"
        time.sleep(0.01)


def test_a_sampler_averages_the_samples_inside_the_windows():
    # Five samples, a line to skip, then silence until the sampler is stopped.
    script = ("import time\n"
              "for i in range(5):\n"
              "    print(f'{1500 + 10 * i}, {300 + i}.5', flush=True)\n"
              "    time.sleep(0.05)\n"
              "print('[N/A], [N/A]', flush=True)\n"
              "time.sleep(60)\n")
    with ClockSampler(command=[sys.executable, "-c", script]) as clocks:
        _wait_for(lambda: len(clocks.samples) == 5)
    times = [when for when, _, _ in clocks.samples]
    assert [(mhz, watts) for _, mhz, watts in clocks.samples] == [(1500 + 10 * i, 300.5 + i) for i in range(5)]
    assert clocks.during([(times[0], times[-1])]) == (1520.0, 302.5, 5)
    # two windows, each around one sample: their mean
    assert clocks.during([(times[1], times[1]), (times[3], times[3])]) == (1520.0, 302.5, 2)
    assert clocks.during([(times[-1] + 1.0, times[-1] + 2.0)]) is None
