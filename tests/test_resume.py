"""Resume: N steps straight equal N/2 steps, SIGTERM, resume, N/2 steps, bit for bit on CPU; and the
checks that stop a resume from silently continuing a different run or overwriting saved work."""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import trainer.checkpoint.format
import trainer.loop
from data import DataError
from tests.data_support import checkpoint, text_file  # noqa: F401
from tests.gloo_support import gloo_rank, run_two_ranks
from tests.jobs_support import checkpoint_weights, job_config, losses, records, single_torch_thread  # noqa: F401
from trainer.architecture import record_architecture
from trainer.checkpoint.format import CheckpointError
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.resume import agreed_checkpoint
from trainer.distributed import world_of
from trainer.loop import train
from trainer.optim import lr_multiplier

STEPS = 6


def sigterm_after(monkeypatch, stop_step: int) -> None:
    """Deliver a real SIGTERM to this process right after step `stop_step` is computed."""
    real_step, calls = trainer.loop.train_step, []

    def step_then_signal(*args, **kwargs):
        result = real_step(*args, **kwargs)
        calls.append(1)
        if len(calls) == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    monkeypatch.setattr(trainer.loop, "train_step", step_then_signal)


def assert_same_run(expected: torch.Tensor, got: torch.Tensor, device: str) -> None:
    """Bit for bit on CPU; on the GPU within bf16 rounding (a reduction order may differ between processes)."""
    if device == "cpu":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -8, atol=0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=needs_cuda)]


# LoRA with dropout draws from the torch RNG every step, so it also checks that RNG states are restored.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [["train=full"], ["train=lora", "train.lora_dropout=0.1"]], ids=["full", "lora"])
def test_interrupted_and_resumed_run_equals_straight_run(tmp_path, monkeypatch, mode, device):
    mode = [*mode, f"device={device}"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(job_config(straight, *mode))

    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with monkeypatch.context() as patch:
        sigterm_after(patch, STEPS // 2)
        stopped = train(job_config(resumed, *mode))
    assert stopped["step"] == STEPS // 2
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == [f"step-{STEPS // 2}"]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers

    final = train(job_config(resumed, *mode))
    assert final["step"] == STEPS
    assert [r["step"] for r in records(resumed)] == list(range(1, STEPS + 1))
    assert_same_run(torch.tensor(losses(straight)), torch.tensor(losses(resumed)), device)
    expected = checkpoint_weights(straight / "checkpoints" / f"step-{STEPS}")
    got = checkpoint_weights(resumed / "checkpoints" / f"step-{STEPS}")
    assert expected.keys() == got.keys()
    for name in expected:
        assert_same_run(expected[name], got[name], device)
    print(f"{device} {mode}: bit-exact losses {losses(resumed) == losses(straight)}, bit-exact weights "
          f"{all(torch.equal(expected[name], got[name]) for name in expected)}")


def test_resume_refuses_a_changed_run_defining_setting(tmp_path):
    train(job_config(tmp_path, "max_steps=2"))
    with pytest.raises(CheckpointError) as error:
        train(job_config(tmp_path, "max_steps=3", "seq_len=96", "seed=1"))
    message = str(error.value)
    assert "seq_len: checkpoint 128, now 96" in message and "seed: checkpoint 0, now 1" in message
    assert "resume_force=true" in message
    assert train(job_config(tmp_path, "max_steps=3", "seed=1", "resume_force=true"))["step"] == 3


@pytest.mark.parametrize("mode, change, setting", [
    ("train=lora", "train.lora_r=8", "train.lora_r: checkpoint 16, now 8"),
    ("train=full", "model.intermediate_size=256", "model.intermediate_size: checkpoint 384, now 256"),
], ids=["lora_rank", "full_model_size"])
def test_resume_force_refuses_a_changed_shape_in_one_line(tmp_path, mode, change, setting):
    train(job_config(tmp_path, mode, "max_steps=2"))
    before = checkpoint_weights(tmp_path / "checkpoints" / "step-2")
    records_before = {name: (tmp_path / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    with pytest.raises(CheckpointError) as error:
        train(job_config(tmp_path, mode, "max_steps=3", "resume_force=true", change))
    message = str(error.value)
    assert "\n" not in message and "does not fit this model" in message and "in the checkpoint" in message
    assert setting in message and "resume_force covers data and schedule changes, not shapes" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2"]
    after = checkpoint_weights(tmp_path / "checkpoints" / "step-2")
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert {name: (tmp_path / name).read_bytes() for name in records_before} == records_before


def test_fresh_start_refuses_to_overwrite_existing_checkpoints(tmp_path):
    train(job_config(tmp_path, "max_steps=2"))
    with pytest.raises(CheckpointError, match="new output_dir"):
        train(job_config(tmp_path, "max_steps=2", "resume=false"))
    assert (tmp_path / "checkpoints" / "step-2" / "COMPLETE").is_file()


def test_resume_from_a_given_checkpoint_into_a_new_run_dir(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    train(job_config(first, "max_steps=4", "checkpoint.every_steps=2"))
    result = train(job_config(second, "max_steps=4", f"resume={first}/checkpoints/step-2"))
    assert result["step"] == 4
    assert [r["step"] for r in records(second)] == [3, 4]
    assert losses(second) == losses(first)[2:]


def test_missing_resume_path_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        train(job_config(tmp_path, f"resume={tmp_path}/nowhere/step-3"))


def test_offload_buffers_are_pinned_before_the_first_step(tmp_path, monkeypatch):
    """Pinning is slow (~0.6 s/GiB); the loop does it up front so step 1's time is a real step's."""
    import offload.policy
    events = []
    pin = offload.policy.MemoryPolicy.pin_buffers
    step = trainer.loop.train_step
    monkeypatch.setattr(offload.policy.MemoryPolicy, "pin_buffers",
                        lambda self, *args: (events.append(("pin", args)), pin(self, *args))[1])
    monkeypatch.setattr(trainer.loop, "train_step", lambda *args: (events.append(("step",)), step(*args))[1])
    train(job_config(tmp_path, "max_steps=2", "memory.gpu_layers=0"))
    (pinned, (shape,)), *steps = events      # pinned at the plan's sizes: batch 2 x 128 tokens, fp32
    assert pinned == "pin" and (shape.tokens, shape.act_bytes) == (2 * 128, 4) and steps == [("step",), ("step",)]


def test_a_resumed_checkpoint_is_released_before_training(tmp_path, monkeypatch):
    """The loaded copy of weights and optimizer state (tens of GiB for 8B) must not live through the run."""
    import gc
    import weakref
    train(job_config(tmp_path, "max_steps=2"))
    loaded_weight, restore, step = [], CheckpointManager.restore, trainer.loop.train_step

    def restore_and_watch(manager, loaded, *args, **kwargs):
        loaded_weight.append(weakref.ref(next(iter(loaded.weights.values()))))
        return restore(manager, loaded, *args, **kwargs)

    def step_after_release(*args):
        gc.collect()
        assert loaded_weight and loaded_weight[0]() is None, "the loaded checkpoint is still referenced"
        return step(*args)

    monkeypatch.setattr(CheckpointManager, "restore", restore_and_watch)
    monkeypatch.setattr(trainer.loop, "train_step", step_after_release)
    train(job_config(tmp_path, "max_steps=3"))
    assert records(tmp_path)[-1]["step"] == 3


def files_job(run_dir, data_path, cache, checkpoint, *overrides):
    return job_config(run_dir, "data=files", f"data.path={data_path}", f"data.cache_dir={cache}",
                      f"model.path={checkpoint}", "seq_len=16", *overrides)


def test_data_state_follows_content_not_file_time_or_path(tmp_path, text_file, checkpoint, caplog):
    run, cache = tmp_path / "run", tmp_path / "cache"
    train(files_job(run, text_file, cache, checkpoint, "max_steps=2"))
    os.utime(text_file, (1, 1))                  # touched: same content
    assert train(files_job(run, text_file, cache, checkpoint, "max_steps=3"))["step"] == 3
    copy = shutil.copy(text_file, tmp_path / "copy.jsonl")
    assert train(files_job(run, copy, cache, checkpoint, "max_steps=4"))["step"] == 4

    with open(copy, "a") as file:                # a changed dataset is refused, resume_force continues
        file.write('{"text": "one more document"}\n')
    with pytest.raises(DataError, match="different dataset.*tokenized documents.*resume_force=true"):
        train(files_job(run, copy, cache, checkpoint, "max_steps=5"))
    assert train(files_job(run, copy, cache, checkpoint, "max_steps=5", "resume_force=true"))["step"] == 5
    assert "resume_force=true" in caplog.text and "tokenized documents" in caplog.text


def applied_learning_rates(monkeypatch) -> list[float]:
    """The learning rate in the optimizer when each step's update is applied."""
    applied, real_step = [], trainer.loop.train_step

    def recording_step(model, micro_batches, optimizer, *args):
        applied.append(optimizer.param_groups[0]["lr"])
        return real_step(model, micro_batches, optimizer, *args)
    monkeypatch.setattr(trainer.loop, "train_step", recording_step)
    return applied


def test_raising_max_steps_on_resume_follows_the_new_schedule_from_the_resumed_step(tmp_path, monkeypatch):
    """And a changed optim.lr: the schedule is this job's, evaluated from the resumed step on, with no jump."""
    schedule = ("optim.warmup_steps=1", "optim.min_lr_ratio=0.1")
    train(job_config(tmp_path, "max_steps=4", "optim.lr=1e-3", *schedule))
    applied = applied_learning_rates(monkeypatch)
    train(job_config(tmp_path, "max_steps=8", "optim.lr=5e-4", *schedule))
    expected = [5e-4 * lr_multiplier(step - 1, 1, 8, 0.1) for step in range(5, 9)]
    assert applied == pytest.approx(expected, rel=1e-12)
    assert [r["lr"] for r in records(tmp_path)[4:]] == pytest.approx(expected, rel=1e-12)


def test_an_auto_warmup_stays_the_one_the_run_started_with(tmp_path, monkeypatch):
    """max_steps=4 caps the auto warmup to 0; resumed with max_steps=40 the default (30) would fit, and the
    learning rate would fall from its peak and warm up again."""
    auto = ("optim.warmup_steps=null", "optim.lr=1e-3", "optim.min_lr_ratio=0.1")
    train(job_config(tmp_path, "max_steps=4", *auto))
    applied = applied_learning_rates(monkeypatch)
    train(job_config(tmp_path, "max_steps=40", *auto))
    expected = [1e-3 * lr_multiplier(step - 1, 0, 40, 0.1) for step in range(5, 41)]
    assert applied == pytest.approx(expected, rel=1e-12)


def _resuming_rank(rank: int, init_file: str, failures, run_dir: str):
    with gloo_rank(rank, init_file, failures):
        checksummed = []
        real_checksum = trainer.checkpoint.format.file_checksum
        trainer.checkpoint.format.file_checksum = lambda path: checksummed.append(path) or real_checksum(path)
        cfg = job_config(run_dir, "resume=auto")
        record_architecture(cfg)     # as train() does first
        loaded = agreed_checkpoint(cfg, CheckpointManager.for_run(Path(run_dir), cfg.checkpoint), world_of(rank, 2, 1))
        assert loaded.path.name == "step-4" and loaded.progress.step == 4
        assert bool(checksummed) == (rank == 0), f"rank {rank} checksummed {len(checksummed)} files"


def test_on_resume_rank_0_alone_reads_every_byte_and_the_others_its_choice(tmp_path):
    train(job_config(tmp_path, "max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=2"))
    run_two_ranks(_resuming_rank, str(tmp_path))
