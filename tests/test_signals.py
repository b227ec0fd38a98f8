"""SIGTERM/SIGINT: the trainer finishes the step, checkpoints and exits 128 + the signal's number; as the job
starts, it stops at once with one line, leaving no worker behind; a second signal kills it at once. Checked on
real processes."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.data_support import SENTENCES, checkpoint, write_jsonl  # noqa: F401
from tests.jobs_support import (FAST, REPO, TIMEOUT_S, job_config, records, single_torch_thread,  # noqa: F401
                                start_training, wait_for)
from trainer.checkpoint.format import marker_problem
from trainer.loop import train
from trainer.signals import StopSignals


@pytest.mark.parametrize("stop, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_finishes_the_step_checkpoints_and_exits_with_the_signals_status(tmp_path, stop, status):
    """128 + the signal's number, as a shell reports a process it ended: a scheduler sees the job did not finish."""
    run_dir = tmp_path / "run"
    process = start_training(run_dir, "max_steps=100000")
    wait_for(lambda: len(records(run_dir)) >= 2, "two training steps", process)
    process.send_signal(stop)
    assert process.wait(TIMEOUT_S) == status
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


def session_processes(session: int) -> list[psutil.Process]:
    """The live processes of a session (those a terminal's Ctrl-C reaches), however deep."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def test_ctrl_c_during_tokenization_exits_130_with_one_line_and_no_worker_left(tmp_path, checkpoint):
    """As at a terminal: SIGINT to the job's whole process group while two workers tokenize (data=files,
    num_proc=2, 30k records, a cache miss)."""
    words = " ".join(SENTENCES[:4]).split()
    records = write_jsonl(tmp_path / "docs.jsonl", [{"text": " ".join(words[i % 7:] * 3)} for i in range(30_000)])
    run_dir, log_path = tmp_path / "run", tmp_path / "run.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen([sys.executable, "train.py", *FAST, f"output_dir={run_dir}", "data=files",
                                f"data.path={records}", f"data.cache_dir={tmp_path / 'cache'}", "data.num_proc=2",
                                f"model.path={checkpoint}", "seq_len=16"], cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: len(psutil.Process(job.pid).children(recursive=True)) >= 2, "the tokenizing workers", job)
        os.killpg(job.pid, signal.SIGINT)
        assert job.wait(TIMEOUT_S) == 130, log_path.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    wait_for(lambda: not session_processes(job.pid), "no process of the job left")
    output = log_path.read_text()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    stopped = [line for line in output.splitlines() if "SIGINT" in line]
    assert len(stopped) == 1 and "while the job was starting" in stopped[0], output
