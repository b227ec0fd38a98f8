"""Checkpoint contents, rotation, the disk check, and crash safety: a save killed midway, or a checkpoint
damaged later, leaves the previous checkpoint usable."""
from __future__ import annotations

import contextlib
import json
import shutil
import logging
import signal
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from omegaconf import OmegaConf

import trainer.checkpoint.disk_space
from tests.jobs_support import (REPO, TIMEOUT_S, checkpoint_weights, job_config, records,  # noqa: F401
                                single_torch_thread, start_training, train_process, wait_for)
from model import CausalLM
from storage.atomic import atomic_directory
from trainer.architecture import architecture
from trainer.checkpoint.format import CheckpointError, content_problem, load_adapter, marker_problem
from trainer.checkpoint.manager import CheckpointManager
from trainer.loop import train


def test_lora_checkpoint_holds_everything_needed_to_continue(tmp_path):
    train(job_config(tmp_path, "train=lora", "max_steps=2"))
    checkpoint = tmp_path / "checkpoints" / "step-2"
    assert marker_problem(checkpoint) is None
    assert json.loads((checkpoint / "progress.json").read_text()) | {"saved_at": 0} == {
        "step": 2, "tokens_seen": 2 * 2 * 128, "skipped_steps": 0, "wandb_run_id": None, "saved_at": 0}
    assert OmegaConf.create((checkpoint / "config.yaml").read_text()).seq_len == 128
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda"} and state["data"]
    assert torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]

    cfg = job_config(tmp_path)
    adapted = load_adapter(CausalLM.from_config(architecture(cfg.model)), checkpoint / "adapter")
    saved = checkpoint_weights(checkpoint)
    loaded = {name: p for name, p in adapted.named_parameters() if "lora_" in name}
    assert len(loaded) == len(saved) > 0
    assert all(torch.equal(loaded[name.replace(".weight", ".default.weight")], tensor)
               for name, tensor in saved.items())


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path):
    train(job_config(tmp_path, "max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep_last=2"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-3", "step-4"]


def test_too_little_disk_is_a_clear_error_and_keeps_older_checkpoints(tmp_path, monkeypatch):
    train(job_config(tmp_path, "max_steps=2"))
    monkeypatch.setattr(trainer.checkpoint.disk_space.shutil, "disk_usage",
                        lambda path: namedtuple("usage", "total used free")(10 ** 9, 10 ** 9, 10 ** 6))
    with pytest.raises(CheckpointError, match="not enough disk .* GiB are free"):
        train(job_config(tmp_path, "max_steps=3"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2"]


def damage(checkpoint, how: str) -> None:
    if how == "no marker":
        (checkpoint / "COMPLETE").unlink()
    elif how == "truncated":
        with open(checkpoint / "optimizer.pt", "r+b") as file:
            file.truncate(100)
    elif how == "garbage":   # same size, garbage content: only reading it shows the damage
        weights = checkpoint / "model.safetensors"
        weights.write_bytes(b"\0" * weights.stat().st_size)
    else:   # 4 KB overwritten in the middle of the weights: still loads, as other numbers; only the checksum tells
        with open(checkpoint / "model.safetensors", "r+b") as file:
            file.seek(file.seek(0, 2) // 2)
            middle = file.read(4096)
            file.seek(-len(middle), 1)
            file.write(bytes(byte ^ 0xFF for byte in middle))


def test_a_checkpoint_changed_in_place_is_set_aside_and_not_resumed_from(tmp_path):
    run_dir = tmp_path / "run"
    assert train_process(run_dir, "max_steps=2", "checkpoint.every_steps=1").returncode == 0
    damage(run_dir / "checkpoints" / "step-2", "overwritten")
    resumed = train_process(run_dir, "max_steps=3", "checkpoint.every_steps=1")
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    assert "model.safetensors does not match its crc32 checksum" in output
    assert f"resumed from {run_dir}/checkpoints/step-1 at step 1/3" in output
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1", "step-2", "step-2.unreadable",
                                                                          "step-3"]
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]


def test_a_checkpoint_saved_before_checksums_is_still_resumed_from_by_its_sizes(tmp_path, caplog):
    train(job_config(tmp_path, "max_steps=2"))
    marker = tmp_path / "checkpoints" / "step-2" / "COMPLETE"
    marker.write_text(json.dumps({"files": json.loads(marker.read_text())["files"]}))
    with caplog.at_level(logging.WARNING):
        assert train(job_config(tmp_path, "max_steps=3"))["step"] == 3
    assert "has no checksums" in caplog.text and "checked by file sizes only" in caplog.text


@pytest.mark.parametrize("how", ["no marker", "truncated", "garbage", "overwritten"])
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, how):
    train(job_config(tmp_path, "max_steps=2", "checkpoint.every_steps=1"))
    damage(tmp_path / "checkpoints" / "step-2", how)
    manager = CheckpointManager(tmp_path / "checkpoints")
    assert manager.read_newest().progress.step == 1
    assert list(manager.skipped) == [tmp_path / "checkpoints" / "step-2"]


KILLED_DURING_SAVE = """
import time, torch
import trainer.checkpoint.format as checkpoint_format
from tests.jobs_support import job_config
from trainer.loop import train

torch.set_num_threads(1)
real_save = checkpoint_format.save_checksummed
def slow_save(state, path):
    checksum = real_save(state, path)
    if "step-2" in str(path):
        print("saving", flush=True)
        time.sleep(60)
    return checksum
checkpoint_format.save_checksummed = slow_save
train(job_config({run_dir!r}, "max_steps=3", "checkpoint.every_steps=1"))
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_usable(tmp_path):
    script = KILLED_DURING_SAVE.format(run_dir=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "saving"
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    checkpoints = tmp_path / "checkpoints"
    assert [p.name for p in checkpoints.glob(".tmp-step-2-*")], "the save was not caught midway"
    assert CheckpointManager(checkpoints).read_newest().progress.step == 1

    assert train(job_config(tmp_path, "max_steps=3", "checkpoint.every_steps=1"))["step"] == 3
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-2", "step-3"]


def test_atomic_directory_leaves_nothing_behind_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "out") as temp:
            (temp / "half").write_text("x")
            raise RuntimeError("disk gone")
    assert list(tmp_path.iterdir()) == []


def test_full_checkpoint_of_a_tied_model_must_hold_every_weight_but_the_head(tmp_path, monkeypatch):
    """Tied embeddings save no lm_head; any other weight missing is an error, not a silent init value."""
    settings = ("train=full", "model.tie_word_embeddings=true")
    train(job_config(tmp_path, "max_steps=2", *settings))
    real_read_newest = CheckpointManager.read_newest

    def without_final_norm(manager):
        loaded = real_read_newest(manager)
        assert "lm_head.weight" not in loaded.weights
        del loaded.weights["model.norm.weight"]
        return loaded
    monkeypatch.setattr(CheckpointManager, "read_newest", without_final_norm)
    with pytest.raises(CheckpointError, match=r"missing \['model.norm.weight'\]"):
        train(job_config(tmp_path, "max_steps=3", *settings))
    monkeypatch.setattr(CheckpointManager, "read_newest", real_read_newest)
    assert train(job_config(tmp_path, "max_steps=3", *settings))["step"] == 3


def test_checkpoint_directories_edited_by_hand_are_named_and_only_a_true_one_is_resumed_from(tmp_path, caplog):
    """step-3 renamed step-30 (its progress.json says 3) is set aside, not resumed from; a copy named
    step-1-best is named as a directory the run does not use; an empty step-2 (left by an interrupted
    cleanup) is removed with a line. Each in one line."""
    train(job_config(tmp_path, "max_steps=3", "checkpoint.every_steps=1"))
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-3").rename(checkpoints / "step-30")
    shutil.copytree(checkpoints / "step-1", checkpoints / "step-1-best")
    shutil.rmtree(checkpoints / "step-2")
    (checkpoints / "step-2").mkdir()
    with caplog.at_level(logging.INFO):
        assert train(job_config(tmp_path, "max_steps=2", "checkpoint.every_steps=1"))["step"] == 2
    assert f"resuming from {checkpoints / 'step-1'} (step 1" in caplog.text
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-1-best", "step-2", "step-30.unreadable"]
    lines = caplog.text.splitlines()
    renamed = [line for line in lines if "step-30" in line]
    assert len(renamed) == 1 and "set aside" in renamed[0] and "holds step 3" in renamed[0], renamed
    best = [line for line in lines if "step-1-best" in line]
    assert len(best) == 1 and "not a checkpoint directory" in best[0], best
    empty = [line for line in lines if "empty" in line]
    assert len(empty) == 1 and f"removed the empty {checkpoints / 'step-2'} " in empty[0], empty


@pytest.fixture
def small_disk(tmp_path):
    """A real 80 MiB filesystem (tmpfs), mounted for the test: needs root (or CAP_SYS_ADMIN)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk) -> None:
    with open(disk / "filler", "wb") as filler:
        with contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * (1 << 16))
                filler.flush()


def test_a_disk_filled_mid_run_stops_the_job_in_one_line_with_its_checkpoints_intact(small_disk):
    """Another process fills the disk after the first checkpoint: the next write (metrics, train.log, W&B's
    offline files) fails with ENOSPC."""
    run_dir = small_disk / "run"
    job = start_training(run_dir, "max_steps=100000", "checkpoint.every_steps=5", "logger.wandb.mode=offline",
                         log_path=small_disk.parent / "run.log")
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step-5" / "COMPLETE").is_file(), "the first checkpoint", job)
        fill(small_disk)
        assert job.wait(TIMEOUT_S) == 1
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    output = (small_disk.parent / "run.log").read_text()
    assert "Traceback" not in output and "Logging error" not in output, output
    full = [line for line in output.splitlines() if "is full" in line]
    assert len(full) == 1 and f"the disk of output_dir={run_dir} is full" in full[0], output
    assert f"newest {run_dir / 'checkpoints' / 'step-5'}" in full[0] and "run it again" in full[0]
    assert content_problem(run_dir / "checkpoints" / "step-5") is None
