"""W&B in offline mode (the default): the run lives in <run dir>/wandb/, holds the config and the step
metrics, and a resumed job continues the same run id."""
from __future__ import annotations

import json

from tests.jobs_support import job_config, single_torch_thread, wait_for  # noqa: F401
from trainer.loop import train


def offline_runs(run_dir):
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def test_offline_run_directory_and_resumed_run_id(tmp_path):
    train(job_config(tmp_path, "max_steps=2", "logger.wandb.mode=offline", "logger.wandb.tags=[test]"))
    run_id = json.loads((tmp_path / "checkpoints" / "step-2" / "progress.json").read_text())["wandb_run_id"]
    [first] = offline_runs(tmp_path)
    assert first.name.endswith(f"-{run_id}")
    history = first / f"run-{run_id}.wandb"
    wait_for(lambda: b"train/loss" in history.read_bytes(), "wandb's service to write the history")
    for metric in (b"perf/tokens_per_s", b"memory/host_rss_gib", b"seq_len"):
        assert metric in history.read_bytes(), metric

    train(job_config(tmp_path, "max_steps=3", "logger.wandb.mode=offline", "logger.wandb.tags=[test]"))
    runs = offline_runs(tmp_path)
    # Each run directory holds the run's id in its history file's name (the directory name itself gets a
    # "-1" suffix when the resumed run starts within the same second as the first).
    assert len(runs) == 2 and all((run / f"run-{run_id}.wandb").is_file() for run in runs)
    assert json.loads((tmp_path / "checkpoints" / "step-3" / "progress.json").read_text())["wandb_run_id"] == run_id
