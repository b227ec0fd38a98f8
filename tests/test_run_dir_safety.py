"""A run never deletes or overwrites work in a run directory it did not resume from: unreadable checkpoints
stop resume=auto instead of starting over, a new run refuses a directory holding another run's work,
checkpoints a resume skipped are set aside, not replaced or pruned, and a directory has one writer at a time
(checked on real processes)."""
from __future__ import annotations

import shutil
import signal
import socket

import pytest
from omegaconf import OmegaConf

from tests.data_support import TEXTS, checkpoint, write_jsonl  # noqa: F401
from tests.jobs_support import (TIMEOUT_S, job_config, records, single_torch_thread,  # noqa: F401
                                start_training, train_process, wait_for)
from tests.test_checkpoint import damage
from trainer.checkpoint.format import CheckpointError
from trainer.loop import train
from trainer.metrics import METRICS_FILE


def snapshot(run_dir) -> dict:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_auto_resume_with_only_unreadable_checkpoints_stops_and_changes_nothing(tmp_path):
    train(job_config(tmp_path, "max_steps=2", "checkpoint.every_steps=1"))
    damage(tmp_path / "checkpoints" / "step-1", "no marker")
    damage(tmp_path / "checkpoints" / "step-2", "truncated")
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError) as error:
        train(job_config(tmp_path, "max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep_last=1"))
    message = str(error.value)
    assert "step-1" in message and "no COMPLETE marker" in message
    assert "step-2" in message and "optimizer.pt has 100 bytes" in message
    assert "resume=<path>" in message and "new output_dir" in message and "move" in message
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("resume", ["false", "auto"])
def test_a_new_run_refuses_a_directory_holding_another_runs_work(tmp_path, resume):
    """Metrics of a run that never checkpointed, or an incomplete checkpoint, are not wiped by a new run."""
    train(job_config(tmp_path, "max_steps=2"))
    shutil.rmtree(tmp_path / "checkpoints")
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=f"{METRICS_FILE} .*2 steps.* new output_dir"):
        train(job_config(tmp_path, "max_steps=2", f"resume={resume}"))
    assert snapshot(tmp_path) == before


def test_resume_from_another_run_dir_keeps_the_checkpoints_already_there(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    train(job_config(first, "max_steps=2", "checkpoint.every_steps=1"))
    train(job_config(second, "max_steps=2"))
    before = snapshot(second)
    with pytest.raises(CheckpointError, match="second.*step-2"):
        train(job_config(second, "max_steps=3", "checkpoint.keep_last=1", f"resume={first}/checkpoints/step-2"))
    assert snapshot(second) == before


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_checkpoint_skipped_by_resume_is_set_aside_not_replaced(tmp_path, how):
    train(job_config(tmp_path, "max_steps=2", "checkpoint.every_steps=1"))
    damage(tmp_path / "checkpoints" / "step-2", how)
    damaged = snapshot(tmp_path / "checkpoints" / "step-2")
    train(job_config(tmp_path, "max_steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=1"))
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2.unreadable", "step-3"]
    assert snapshot(checkpoints / "step-2.unreadable") == damaged
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]


def test_two_runs_started_together_on_a_new_output_dir_leave_one_writer(tmp_path):
    """The second to reach the directory stops at once, naming the first, and writes nothing there."""
    run_dir, logs = tmp_path / "run", {seed: tmp_path / f"seed{seed}.log" for seed in (1, 2)}
    runs = {seed: start_training(run_dir, f"seed={seed}", "max_steps=100000", log_path=logs[seed]) for seed in logs}
    try:
        wait_for(lambda: any(run.poll() is not None for run in runs.values()), "one of the runs to stop")
        loser = next(seed for seed, run in runs.items() if run.poll() is not None)
        winner = runs[3 - loser]
        wait_for(lambda: records(run_dir), "the other run's first step", winner)
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(TIMEOUT_S) == 143
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    output = logs[loser].read_text()
    assert runs[loser].returncode == 2, output
    refusal = [line for line in output.splitlines() if "in use by another run" in line]
    assert len(refusal) == 1 and f"pid {winner.pid} on {socket.gethostname()}, started " in refusal[0]
    assert f"output_dir={run_dir}" in refusal[0] and "Traceback" not in output
    steps = [r["step"] for r in records(run_dir)]
    assert steps == list(range(1, len(steps) + 1))
    checkpoint = run_dir / "checkpoints" / f"step-{steps[-1]}"
    seeds = [OmegaConf.load(path).seed for path in (run_dir / "config.yaml", checkpoint / "config.yaml")]
    assert seeds == [3 - loser] * 2
    assert "in use" not in (run_dir / "train.log").read_text()


def test_a_killed_runs_lock_does_not_block_the_next_run(tmp_path):
    run_dir = tmp_path / "run"
    first = start_training(run_dir, "max_steps=100000", "checkpoint.every_steps=1")
    wait_for(lambda: (run_dir / "checkpoints" / "step-2").is_dir(), "the first run's checkpoint", first)
    first.send_signal(signal.SIGKILL)
    first.wait(TIMEOUT_S)
    assert f'"pid": {first.pid}' in (run_dir / "run.lock").read_text()   # what it left: not a lock
    resumed = train_process(run_dir, "max_steps=4")
    assert resumed.returncode == 0, resumed.stderr
    assert records(run_dir)[-1]["step"] == 4


def test_a_refused_resume_leaves_every_file_of_the_run_dir_as_it_was(tmp_path, checkpoint):
    """Run as a user would: train.py, then again on the same output_dir with other data (refused when the data
    state is restored, after the model is built), then with another seed (refused on reading the checkpoint)."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    first = write_jsonl(tmp_path / "first.jsonl", [{"text": text} for text in TEXTS])
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": text} for text in reversed(TEXTS)])
    files = ("data=files", f"data.cache_dir={cache}", f"model.path={checkpoint}", "seq_len=16")
    done = train_process(run_dir, *files, f"data.path={first}", "max_steps=2")
    assert done.returncode == 0, done.stdout + done.stderr
    before = snapshot(run_dir)
    for change, refusal in ([f"data.path={other}"], "different dataset"), ([f"data.path={first}", "seed=7"],
                                                                          "seed: checkpoint 0, now 7"):
        refused = train_process(run_dir, *files, "max_steps=3", *change)
        output = refused.stdout + refused.stderr
        assert refused.returncode == 2 and refusal in output and "Traceback" not in output, output
        assert snapshot(run_dir) == before, change
