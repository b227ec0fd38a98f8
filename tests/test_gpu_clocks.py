"""scripts/gpu_clocks.py on the CPU: nvidia-smi's lines parsed, and a sampler fed by a stand-in command."""
import sys
import time

import pytest

from scripts.gpu_clocks import ClockSampler, parse_sample


@pytest.mark.parametrize("line,sample", [
    ("1980, 296.49, 81234567\n", (1980.0, 296.49, 81234567.0)),
    (" 1755 ,  699.9 , 12", (1755.0, 699.9, 12.0)),
    ("1755, 699.9, [N/A]\n", (1755.0, 699.9, None)),      # a GPU without an energy counter
    ("[N/A], [N/A], [N/A]\n", None),
    ("Failed to initialize NVML: Unknown Error\n", None),
    ("1980, 296.49\n", None),
])
def test_nvidia_smi_lines_are_parsed(line, sample):
    assert parse_sample(line) == sample


def _wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the stand-in sampler printed too little"
        time.sleep(0.01)


def test_a_sampler_averages_the_samples_inside_the_windows():
    # Five samples (the energy counter rising by 1,000 mJ each), a line to skip, then silence until the
    # sampler is stopped.
    script = ("import time\n"
              "for i in range(5):\n"
              "    print(f'{1500 + 10 * i}, {300 + i}.5, {5000 + 1000 * i}', flush=True)\n"
              "    time.sleep(0.05)\n"
              "print('[N/A], [N/A], [N/A]', flush=True)\n"
              "time.sleep(60)\n")
    with ClockSampler(command=[sys.executable, "-c", script]) as clocks:
        _wait_for(lambda: len(clocks.samples) == 5)
    times = [when for when, *_ in clocks.samples]
    assert [sample[1:] for sample in clocks.samples] == [(1500 + 10 * i, 300.5 + i, 5000 + 1000 * i) for i in range(5)]
    mhz, watts, count, energy_watts = clocks.during([(times[0], times[-1])])
    assert (mhz, watts, count) == (1520.0, 302.5, 5)
    assert energy_watts == pytest.approx(4.0 / (times[-1] - times[0]))    # 4 J over the samples' span
    # two windows of two samples each: the energy of both over both spans
    first, second = (times[0], times[1]), (times[3], times[4])
    mhz, watts, count, energy_watts = clocks.during([first, second])
    assert (mhz, watts, count) == (1520.0, 302.5, 4)
    assert energy_watts == pytest.approx(2.0 / (times[1] - times[0] + times[4] - times[3]))
    # a window around one sample: the clock, but no energy rate
    assert clocks.during([(times[2], times[2])]) == (1520.0, 302.5, 1, None)
    assert clocks.during([(times[-1] + 1.0, times[-1] + 2.0)]) is None
