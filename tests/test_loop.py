"""The loop's parts (trainer/loop.py): start_job returns a Job, run_steps calls the Job's after_step hooks
once per step, where evaluation plugs in, and what a hook adds to a step's metrics is recorded with them; a
stop signal's checkpoint comes before them."""
from __future__ import annotations

import os
import signal

import trainer.loop
from tests.jobs_support import job_config, records, single_torch_thread  # noqa: F401
from trainer.loop import train


def test_after_step_hooks_run_once_per_step_and_their_numbers_are_recorded(tmp_path, monkeypatch):
    seen, real_start = [], trainer.loop.start_job

    def start_with_hook(*args, **kwargs):
        job = real_start(*args, **kwargs)

        def hook(job, step, metrics):
            seen.append((step, job.progress.step, "loss" in metrics))
            metrics["eval/step_seen"] = step
        job.after_step.append(hook)
        return job
    monkeypatch.setattr(trainer.loop, "start_job", start_with_hook)
    train(job_config(tmp_path, "max_steps=3"))
    assert seen == [(1, 1, True), (2, 2, True), (3, 3, True)]
    assert [r["eval/step_seen"] for r in records(tmp_path)] == [1, 2, 3]


def test_a_stop_signal_checkpoints_before_the_evaluation_due_at_its_step(tmp_path, monkeypatch):
    real_step, steps = trainer.loop.train_step, []

    def step_then_signal(*args, **kwargs):      # SIGTERM arrives during step 2, when an evaluation is due
        result = real_step(*args, **kwargs)
        steps.append(1)
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    monkeypatch.setattr(trainer.loop, "train_step", step_then_signal)
    train(job_config(tmp_path, "max_steps=4", "eval.every_steps=2", "eval.at_start=false"))
    assert [r["step"] for r in records(tmp_path)] == [1, 2] and "eval/loss" not in records(tmp_path)[1]
    assert (tmp_path / "checkpoints" / "step-2" / "COMPLETE").is_file()


def test_a_run_whose_steps_train_no_token_does_not_end_as_a_success(tmp_path, monkeypatch):
    import pytest
    import torch

    from data import IGNORE_INDEX, DataError
    real_stream = trainer.loop.data_stream

    def untrained(*args, **kwargs):       # data that slipped past the data checks: no row has a target
        stream = real_stream(*args, **kwargs)
        real_next = type(stream).__next__

        class Untrained(type(stream)):
            def __next__(self):
                batch = real_next(self)
                batch.labels = torch.full_like(batch.labels, IGNORE_INDEX)
                return batch
        stream.__class__ = Untrained
        return stream
    monkeypatch.setattr(trainer.loop, "data_stream", untrained)
    with pytest.raises(DataError, match="^no step of this run trained a token"):
        train(job_config(tmp_path, "max_steps=2"))
    assert [r["step"] for r in records(tmp_path)] == [1, 2]
    assert (tmp_path / "checkpoints" / "step-2").is_dir()        # what it did is kept


def test_a_run_whose_every_step_was_skipped_as_nan_does_not_end_as_a_success(tmp_path, monkeypatch):
    import dataclasses

    import pytest

    from data import DataError
    real_step = trainer.loop.train_step
    monkeypatch.setattr(trainer.loop, "train_step",        # fewer steps than max_bad_steps, none applied
                        lambda *a, **k: dataclasses.replace(real_step(*a, **k), loss=float("nan"), applied=False))
    with pytest.raises(DataError, match="^no step of this run trained a token: each of its 2 steps read no target"):
        train(job_config(tmp_path, "max_steps=2"))
