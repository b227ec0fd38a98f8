"""SIGTERM/SIGINT: the trainer finishes the step, checkpoints and exits cleanly; a second signal kills it at
once. Checked on real processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.jobs_support import (REPO, TIMEOUT_S, job_config, records, single_torch_thread,  # noqa: F401
                          start_training, wait_for)
from trainer.checkpoint.format import marker_problem
from trainer.loop import train
from trainer.signals import StopSignals


def test_sigterm_finishes_the_step_checkpoints_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    process = start_training(run_dir, "max_steps=100000")
    wait_for(lambda: len(records(run_dir)) >= 2, "two training steps", process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(TIMEOUT_S) == 0
    last_step = records(run_dir)[-1]["step"]
    checkpoint = run_dir / "checkpoints" / f"step-{last_step}"
    assert marker_problem(checkpoint) is None
    assert f"stopped by signal after step {last_step}" in (tmp_path / "run.log").read_text()

    resumed = train(job_config(run_dir, f"max_steps={last_step + 1}"))
    assert resumed["step"] == last_step + 1


STOPPABLE_CHILD = """
import time
from trainer.signals import StopSignals
with StopSignals() as stop:
    print("ready", flush=True)
    while not stop.requested:
        time.sleep(0.01)
    print("stopping", flush=True)
    time.sleep(60)   # a long checkpoint write
"""


def test_second_signal_exits_at_once():
    child = subprocess.Popen([sys.executable, "-c", STOPPABLE_CHILD], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGINT)
    assert child.stdout.readline().strip() == "stopping"
    started = time.monotonic()
    child.send_signal(signal.SIGTERM)
    assert child.wait(TIMEOUT_S) == -signal.SIGTERM
    assert time.monotonic() - started < 5


def test_handlers_are_restored_after_the_loop():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: stop.requested, "the handler")
        assert stop.received == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_previous_handler_installed_outside_python_comes_back_as_the_default(monkeypatch):
    """signal.signal returns None for a handler a C library installed; leaving must not raise TypeError."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    real_signal, first = signal.signal, set()

    def foreign_previous(signum, handler):
        previous = real_signal(signum, handler)
        if signum not in first:
            first.add(signum)
            return None
        return previous
    monkeypatch.setattr(signal, "signal", foreign_previous)
    try:
        with StopSignals():
            pass
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        real_signal(signal.SIGTERM, before[0])
        real_signal(signal.SIGINT, before[1])
