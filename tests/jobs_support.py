"""Shared by the job tests (checkpoint, resume, signals, metrics, export): tiny, fast training configs and
readers for what a run leaves in its directory."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from conf.schema import register_configs
from trainer.metrics import METRICS_FILE, read_records

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 90
# The tiny model on a short recall task: a step takes well under a second on one CPU core.
# On the CPU wherever the test runs, as in CI (a test that means the GPU says device=cuda after these).
FAST = ["device=cpu", "seq_len=128", "batch_size=2", "data.num_pairs=4", "data.num_queries=2", "max_steps=6",
        "optim.warmup_steps=1", "log_every=1", "logger.wandb.mode=disabled", "logger.progress_bar=false",
        "checkpoint.every_steps=0", "checkpoint.every_minutes=0", "checkpoint.keep_last=0"]


@pytest.fixture(autouse=True)
def single_torch_thread():
    """One intra-op thread: on a busy small machine OpenMP threads spin against each other and a tiny step
    takes seconds instead of milliseconds. Import this into a test module to apply it there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def job_config(run_dir: Path, *overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=[*FAST, f"output_dir={run_dir}", *overrides])


def start_training(run_dir: Path, *overrides: str, log_path: Path | None = None) -> subprocess.Popen:
    """train.py in a real child process (for signals), logging to `log_path` (default <run_dir>.log)."""
    log = open(log_path or f"{run_dir}.log", "w")
    return subprocess.Popen([sys.executable, "train.py", *FAST, f"output_dir={run_dir}", *overrides],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"})


def train_process(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """train.py run to its end in a child process; its output (stdout and stderr) captured."""
    return subprocess.run([sys.executable, "train.py", *FAST, f"output_dir={run_dir}", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=os.environ | {"OMP_NUM_THREADS": "1"})


def records(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    return read_records(path) if path.is_file() else []


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


def checkpoint_weights(checkpoint: Path) -> dict:
    adapter = checkpoint / "adapter" / "adapter_model.safetensors"
    return load_file(adapter if adapter.is_file() else checkpoint / "model.safetensors")


def wait_for(condition, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert process is None or process.poll() is None, f"process exited ({process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
