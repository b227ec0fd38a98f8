"""The run directory's own parts: created after validation, held by one writer (storage.lock), and for LoRA on
a random init the base model kept beside the checkpoints."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import yaml

from conf.validate import ConfigError
from model.hf_checkpoint import full_weights, is_lora
from storage.lock import DirectoryLock, LockHeld
from trainer.build import BASE_MODEL_DIR
from trainer.checkpoint.disk_space import save_hf_model_if_room
from trainer.console import RunLog
from trainer.distributed import World

# In the run directory: held by the run writing there (one_writer).
RUN_LOCK = "run.lock"
# A sweep job's command-line overrides, kept in its run directory.
OVERRIDES_FILE = "overrides.yaml"


def create_run_dir(run_dir: Path) -> None:
    """The first write of a run, after validation: output_dir."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"output_dir={str(run_dir)!r} cannot be created: {error.strerror}") from None


@contextlib.contextmanager
def one_writer(run_dir: Path, world: World):
    """While open, rank 0 holds the run directory's lock (storage.lock), taken before anything is written
    there: a second run on the same output_dir stops with one line naming the holder."""
    lock = DirectoryLock(run_dir / RUN_LOCK)
    world.on_main(lambda: take_run_dir(lock, run_dir))
    try:
        yield
    finally:
        lock.release()


def take_run_dir(lock: DirectoryLock, run_dir: Path) -> None:
    try:
        lock.acquire()
    except LockHeld as held:
        raise ConfigError(f"output_dir={run_dir} is in use by another run ({held}): wait for it to end, or give "
                          f"another output_dir") from None
    except OSError as error:
        raise ConfigError(f"output_dir={run_dir} cannot be locked for this run ({error.strerror}): give an "
                          f"output_dir on a filesystem with file locks (docs/JOBS.md)") from None


def accept_run(run_dir: Path, run_log: RunLog | None, config_yaml: str, overrides: list[str] | None) -> None:
    """The first writes of a run allowed to continue its run directory (a new run, or a resume whose checks all
    passed), before its first step: train.log with the lines held so far, config.yaml, and a sweep job's
    overrides (so a job that fails keeps them too). A run refused before this has written nothing there."""
    if run_log:
        run_log.keep()
    (run_dir / "config.yaml").write_text(config_yaml)
    if overrides is not None:
        (run_dir / OVERRIDES_FILE).write_text(yaml.safe_dump(overrides))


def keep_random_base(cfg, model: torch.nn.Module, run_dir: Path) -> None:
    """A LoRA adapter is only usable with its base: keep a random-init base once, for scripts/export.py."""
    base_dir = run_dir / BASE_MODEL_DIR
    if is_lora(model) and not cfg.model.path and cfg.checkpoint.save_random_base and not base_dir.is_dir():
        save_hf_model_if_room(full_weights(model), model.config.to_hf_dict(), base_dir)
