"""A run never deletes or overwrites work in a run directory it did not resume from: unreadable checkpoints
stop resume=auto instead of starting over, a new run refuses a directory holding another run's work, and
checkpoints a resume skipped are set aside, not replaced or pruned."""
from __future__ import annotations

import shutil

import pytest

from tests.jobs_support import job_config, records, single_torch_thread  # noqa: F401
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
