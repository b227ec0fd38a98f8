"""NaN/Inf steps are skipped (never applied, counted, logged); too many in a row stop the job with an
error naming the last good checkpoint."""
from __future__ import annotations

import pytest
import torch

import trainer.loop
from tests.jobs_support import job_config, records, single_torch_thread  # noqa: F401
from tests.test_checkpoint import damage
from trainer.guard import BadStepsError, update_is_finite
from trainer.loop import train


def inject_nan(monkeypatch, bad_steps: set[int]) -> list[bool]:
    """Make the model's output NaN on `bad_steps`; returns, per bad step, whether the weights survived."""
    real_step, calls, unchanged = trainer.loop.train_step, [], []

    def poisoned_step(model, *args, **kwargs):
        calls.append(1)
        if len(calls) not in bad_steps:
            return real_step(model, *args, **kwargs)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        hook = model.register_forward_hook(lambda module, inputs, output: output * float("nan"))
        try:
            result = real_step(model, *args, **kwargs)
        finally:
            hook.remove()
        unchanged.append(all(torch.equal(before[name], p) for name, p in model.named_parameters()))
        return result
    monkeypatch.setattr(trainer.loop, "train_step", poisoned_step)
    return unchanged


def test_a_nan_step_is_skipped_and_counted(tmp_path, monkeypatch):
    unchanged = inject_nan(monkeypatch, {3})
    final = train(job_config(tmp_path, "max_steps=5"))
    assert unchanged == [True]
    steps = records(tmp_path)
    assert [r["applied"] for r in steps] == [True, True, False, True, True]
    assert steps[2]["loss"] is None and steps[2]["skipped_steps"] == 1
    assert final["skipped_steps"] == 1 and final["loss"] is not None


def test_consecutive_bad_steps_stop_the_job_pointing_at_the_last_good_checkpoint(tmp_path, monkeypatch):
    inject_nan(monkeypatch, {3, 4, 5})
    with pytest.raises(BadStepsError) as error:
        train(job_config(tmp_path, "max_steps=6", "max_bad_steps=3", "checkpoint.every_steps=2"))
    message = str(error.value)
    assert "3 consecutive steps (3-5" in message and str(tmp_path / "checkpoints" / "step-2") in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2"]


def test_the_last_good_checkpoint_named_is_one_whose_files_still_match_their_checksums(tmp_path, monkeypatch):
    inject_nan(monkeypatch, {3, 4, 5})
    poisoned_step, calls = trainer.loop.train_step, []

    def step_after_damage(*args, **kwargs):     # step-2 changes on disk while the run diverges
        calls.append(1)
        if len(calls) == 4:
            damage(tmp_path / "checkpoints" / "step-2", "overwritten")
        return poisoned_step(*args, **kwargs)
    monkeypatch.setattr(trainer.loop, "train_step", step_after_damage)
    with pytest.raises(BadStepsError) as error:
        train(job_config(tmp_path, "max_steps=6", "max_bad_steps=3", "checkpoint.every_steps=1"))
    assert f"the last good checkpoint is {tmp_path / 'checkpoints' / 'step-1'} " in str(error.value)


def test_update_is_finite():
    assert update_is_finite(1.0, 2.0)
    assert not update_is_finite(float("nan"), 2.0)
    assert not update_is_finite(1.0, float("inf"))


def test_a_periodic_checkpoint_due_on_a_skipped_step_is_written_at_the_next_good_step(tmp_path, monkeypatch):
    inject_nan(monkeypatch, {2})
    train(job_config(tmp_path, "max_steps=4", "checkpoint.every_steps=2"))
    # step 2 was due but bad: saved at step 3 instead, and the cadence stays on multiples of 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-3", "step-4"]
