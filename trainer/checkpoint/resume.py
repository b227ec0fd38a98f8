"""Choosing the checkpoint a job continues from (`resume=auto|<path>|false`) and checking that it belongs to
the same run."""
from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from conf.errors import ConfigError
from model.hf_checkpoint import HFCheckpointError
from trainer.architecture import saved_config
from trainer.build import BASE_MODEL_DIR
from storage.atomic import TEMP_PREFIX
from trainer.checkpoint.format import (CHECKPOINTS_DIR, STEP_PREFIX, CheckpointError, LoadedCheckpoint, step_dirs,
                                       step_of)
from trainer.checkpoint.manager import CheckpointManager, shape_differences
from trainer.distributed import World
from trainer.metrics import METRICS_FILE, read_records

log = logging.getLogger(__name__)

# Settings that change what the weights mean: resuming across a change to one of them is refused.
RUN_DEFINING_KEYS = ("model", "train", "data", "seq_len", "batch_size", "seed")
# Where the data is read from and how it is prepared: the data state's content hash checks the data itself.
NOT_RUN_DEFINING = ("data.path", "data.cache_dir", "data.num_proc")
FRESH = ("false", "none", "no", "off", "")


def flatten(values, prefix: str = "") -> dict:
    if not isinstance(values, dict):
        return {prefix: values}
    flat = {}
    for key, value in values.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def as_built(saved_yaml: str):
    """The checkpoint's config with the architecture its run built (trainer.architecture.record_architecture): runs
    before it was recorded saved their model group's values beside model.path. As saved when it cannot be
    resolved (model.path gone: a changed model.path is a difference anyway)."""
    try:
        return saved_config(saved_yaml)
    except (ConfigError, HFCheckpointError, KeyError):
        return OmegaConf.create(saved_yaml)


def config_differences(saved_yaml: str, cfg) -> list[str]:
    """'key: checkpoint X, now Y' for every run-defining setting that changed."""
    saved = OmegaConf.to_container(as_built(saved_yaml), resolve=True)
    current = OmegaConf.to_container(cfg, resolve=True)
    before = flatten({key: saved.get(key) for key in RUN_DEFINING_KEYS})
    after = flatten({key: current.get(key) for key in RUN_DEFINING_KEYS})
    return [f"{key}: checkpoint {before.get(key)!r}, now {after.get(key)!r}"
            for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key) and key not in NOT_RUN_DEFINING]


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


def check_same_shapes(loaded: LoadedCheckpoint, model, cfg) -> None:
    """resume_force accepts other data and another schedule, never a model whose saved tensors have other
    shapes (a LoRA rank, a model size): refused in one line naming the first tensor and the settings that
    differ, before anything is loaded."""
    differing = shape_differences(loaded, model)
    if not differing:
        return
    settings = "; ".join(config_differences(loaded.config_yaml, cfg)) or "none of the run-defining ones"
    raise CheckpointError(
        f"checkpoint {loaded.path} does not fit this model: {differing[0]} ({len(differing)} tensors differ; "
        f"settings that differ: {settings}). resume_force covers data and schedule changes, not shapes: restore "
        f"those settings, or start a new run in a new output_dir.")


def earlier_work(run_dir: Path, checkpoints: CheckpointManager) -> list[str]:
    """What an earlier run left in run_dir that a run not continuing it would overwrite or delete: step
    directories (complete or not), recorded steps, the kept random base. (A config.yaml, or metrics.jsonl's
    row 0 of an evaluation at start, alone is from a run that stopped before its first step.)"""
    work = [f"{CHECKPOINTS_DIR}/{d.name}" for d in step_dirs(checkpoints.root)]
    metrics = run_dir / METRICS_FILE
    recorded = len([r for r in read_records(metrics) if r["step"] >= 1]) if metrics.is_file() else 0
    if recorded:
        work.append(f"{METRICS_FILE} ({recorded} steps recorded)")
    if (run_dir / BASE_MODEL_DIR).is_dir():
        work.append(f"{BASE_MODEL_DIR}/")
    return work


def refuse_earlier_work(checkpoints: CheckpointManager, starting: str, cfg) -> None:
    """A new run, or a resume from another run directory, must find output_dir free of an earlier run's
    work: its saves, rotation and metrics would overwrite or delete it."""
    work = earlier_work(Path(cfg.output_dir), checkpoints)
    if work:
        continuing = "; resume=auto continues its newest checkpoint" if checkpoints.complete() else ""
        raise CheckpointError(
            f"output_dir={cfg.output_dir} holds an earlier run's work ({', '.join(work)}) that {starting} would "
            f"overwrite or delete: give a new output_dir (resume=<checkpoint path> works across run "
            f"directories), or move them away{continuing}.")


def refuse_newer_checkpoints(checkpoints: CheckpointManager, resumed_step: int, cfg) -> None:
    """A resume from an older step of this run directory would overwrite and prune its newer checkpoints."""
    newer = [d for d in checkpoints.complete() if step_of(d) > resumed_step]
    if newer:
        raise CheckpointError(
            f"output_dir={cfg.output_dir} already holds checkpoints ({', '.join(d.name for d in newer)}) that "
            f"resuming from step {resumed_step} would overwrite: give a new output_dir (resume=<checkpoint "
            f"path> works across run directories), or resume=auto to continue from the newest.")


def in_run_dir(loaded: LoadedCheckpoint, checkpoints: CheckpointManager) -> bool:
    return loaded.path.resolve().parent == checkpoints.root.resolve()


def tidy_checkpoints(checkpoints: CheckpointManager, loaded: LoadedCheckpoint | None) -> None:
    """Once the run may continue its run directory (rank 0): the step directories a resume from it skipped
    set aside, and the empty ones removed, each with one line."""
    if loaded and in_run_dir(loaded, checkpoints):
        step = loaded.progress.step
        for directory, moved in checkpoints.set_aside_after(step):
            why = checkpoints.skipped.get(directory, f"checkpoint {directory} is newer than step {step}")
            log.warning("skipping %s; set aside as %s, so that no save replaces it", why, moved.name)
    for directory in checkpoints.remove_empty():
        log.warning("removed the empty %s (left by an interrupted deletion)", directory)


def name_unused_dirs(checkpoints: CheckpointManager) -> None:
    """One line for each directory under checkpoints/ that the run neither reads nor writes (a copy named by
    hand, such as step-4-best): a user may expect it to be resumed from."""
    if not checkpoints.root.is_dir():
        return
    for path in sorted(checkpoints.root.iterdir()):
        ours = step_of(path) is not None or path.name.startswith(TEMP_PREFIX) or ".unreadable" in path.name
        if path.is_dir() and not ours:
            log.warning("%s is not a checkpoint directory this run uses (those are named %s<N>): not resumed "
                        "from, not pruned", path, STEP_PREFIX)


def checkpoint_to_resume(cfg, checkpoints: CheckpointManager) -> LoadedCheckpoint | None:
    """The checkpoint named by cfg.resume, read and checked against cfg; None starts a fresh run. Nothing
    that the run would not continue is left where its saves could overwrite or delete it: refused, or set
    aside once the run is accepted (tidy_checkpoints)."""
    setting = str(cfg.resume).strip()
    name_unused_dirs(checkpoints)
    if setting.lower() in FRESH:
        refuse_earlier_work(checkpoints, "a new run", cfg)
        return None
    if setting.lower() == "auto":
        loaded = checkpoints.read_newest()
        if loaded is None:
            refuse_earlier_work(checkpoints, "a new run", cfg)
            log.info("resume=auto: no checkpoint in %s, starting a new run (pass output_dir=<run dir> of an "
                     "earlier job to continue it)", checkpoints.root)
            return None
    else:
        loaded = checkpoints.read(Path(setting))
        if in_run_dir(loaded, checkpoints):
            refuse_newer_checkpoints(checkpoints, loaded.progress.step, cfg)
        else:
            refuse_earlier_work(checkpoints, f"resuming {loaded.path} from another run directory", cfg)
    check_same_run(loaded, cfg)
    log.info("resuming from %s (step %d, %d tokens seen)", loaded.path, loaded.progress.step,
             loaded.progress.tokens_seen)
    return loaded


def agreed_checkpoint(cfg, checkpoints: CheckpointManager, world: World) -> LoadedCheckpoint | None:
    """checkpoint_to_resume on rank 0 alone, which checksums the checkpoint and sets aside what the run
    skips; the other ranks read the checkpoint it chose checking file sizes only (each reading every byte
    again would multiply the resume's time). A refusal on rank 0 stops every rank."""
    chosen = []
    world.on_main(lambda: chosen.append(checkpoint_to_resume(cfg, checkpoints)))
    path = world.main_value(str(chosen[0].path) if chosen and chosen[0] else None)
    if world.is_main or path is None:
        return chosen[0] if chosen else None
    return checkpoints.read(Path(path), verify=False)


def keep_started_warmup(cfg, loaded: LoadedCheckpoint) -> str | None:
    """An auto warmup (optim.warmup_steps left unset) stays the one the run started with: resolved again
    against a raised max_steps it could change mid-run, and the learning rate would fall and warm up again.
    Returns what the startup summary should add, None when nothing changed."""
    started = OmegaConf.create(loaded.config_yaml).optim.warmup_steps
    if started is None or started == cfg.optim.warmup_steps or started >= cfg.max_steps:
        return None
    cfg.optim.warmup_steps = started
    return f"optim.warmup_steps={started} kept from the resumed run (auto)"
