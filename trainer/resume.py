"""Choosing the checkpoint a job continues from (`resume=auto|<path>|false`) and checking that it belongs to
the same run."""
from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from trainer.checkpoint_format import CheckpointError, LoadedCheckpoint, step_of
from trainer.checkpoint_manager import CheckpointManager

log = logging.getLogger(__name__)

# Settings that change what the weights mean: resuming across a change to one of them is refused.
RUN_DEFINING_KEYS = ("model", "train", "data", "seq_len", "batch_size", "seed")
FRESH = ("false", "none", "no", "off", "")


def flatten(values, prefix: str = "") -> dict:
    if not isinstance(values, dict):
        return {prefix: values}
    flat = {}
    for key, value in values.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_differences(saved_yaml: str, cfg) -> list[str]:
    """'key: checkpoint X, now Y' for every run-defining setting that changed."""
    saved = OmegaConf.to_container(OmegaConf.create(saved_yaml), resolve=True)
    current = OmegaConf.to_container(cfg, resolve=True)
    before = flatten({key: saved.get(key) for key in RUN_DEFINING_KEYS})
    after = flatten({key: current.get(key) for key in RUN_DEFINING_KEYS})
    return [f"{key}: checkpoint {before.get(key)!r}, now {after.get(key)!r}"
            for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]


def check_same_run(loaded: LoadedCheckpoint, cfg) -> None:
    differences = config_differences(loaded.config_yaml, cfg)
    if not differences:
        return
    listing = "\n  ".join(differences)
    if cfg.resume_force:
        log.warning("resume_force=true: resuming %s despite config changes:\n  %s", loaded.path, listing)
        return
    raise CheckpointError(
        f"the config differs from checkpoint {loaded.path} in settings that define the run:\n  {listing}\n"
        f"Restore those settings, start a new run (resume=false and a new output_dir), or pass "
        f"resume_force=true to continue anyway.")


def refuse_overwrite(checkpoints: CheckpointManager, resumed_step: int | None, cfg) -> None:
    """A new run, or a resume from an older step, would overwrite and prune the checkpoints already in
    the run directory; refuse instead of losing them."""
    newer = [d for d in checkpoints.complete() if resumed_step is None or step_of(d) > resumed_step]
    if not newer:
        return
    what = "starting fresh" if resumed_step is None else f"resuming from step {resumed_step}"
    raise CheckpointError(
        f"output_dir={cfg.output_dir} already holds checkpoints ({', '.join(d.name for d in newer)}) that "
        f"{what} would overwrite: give a new output_dir (resume=<checkpoint path> works across run "
        f"directories), or resume=auto to continue from the newest.")


def checkpoint_to_resume(cfg, checkpoints: CheckpointManager) -> LoadedCheckpoint | None:
    """The checkpoint named by cfg.resume, read and checked against cfg; None starts a fresh run."""
    setting = str(cfg.resume).strip()
    if setting.lower() in FRESH:
        refuse_overwrite(checkpoints, None, cfg)
        return None
    if setting.lower() == "auto":
        loaded = checkpoints.read_newest()
        if loaded is None:
            log.info("resume=auto: no checkpoint in %s, starting a new run (pass output_dir=<run dir> of an "
                     "earlier job to continue it)", checkpoints.root)
            return None
    else:
        loaded = checkpoints.read(Path(setting))
        refuse_overwrite(checkpoints, loaded.progress.step, cfg)
    check_same_run(loaded, cfg)
    log.info("resuming from %s (step %d, %d tokens seen)", loaded.path, loaded.progress.step,
             loaded.progress.tokens_seen)
    return loaded
