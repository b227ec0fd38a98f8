"""The job's W&B run: offline by default (no account needed; files in <run dir>/wandb/, upload later with
`wandb sync <run dir>/wandb/offline-run-*`), online, or disabled. A resumed job continues the same run id,
so its curves continue the same W&B run. W&B's system metrics (GPU, CPU, disk, network) stay on."""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# W&B section of the trainer's own metrics; a source's metric named "section/name" keeps its section.
SECTIONS = {"loss": "train", "accuracy": "train", "lr": "train", "grad_norm": "train", "tokens_seen": "train",
            "skipped_steps": "train", "applied": "train", "tokens_per_s": "perf", "mfu": "perf", "step_time_s": "perf",
            "data_wait_s": "perf", "host_rss_gib": "memory", "gpu_allocated_gib": "memory",
            "gpu_reserved_gib": "memory", "gpu_peak_gib": "memory", "gpu_planned_peak_gib": "memory",
            "mfu_measured_ceiling": "perf"}
NOT_LOGGED = ("step", "time")


def wandb_name(metric: str) -> str:
    return metric if "/" in metric else f"{SECTIONS.get(metric, 'other')}/{metric}"


class WandbRun:
    def __init__(self, run):
        self.run = run

    @property
    def id(self) -> str:
        return self.run.id

    def log(self, record: dict, step: int) -> None:
        self.run.log({wandb_name(k): v for k, v in record.items() if k not in NOT_LOGGED and v is not None},
                     step=step)

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def open_wandb(wandb_cfg, run_dir: Path, config: dict, run_id: str | None) -> WandbRun | None:
    """Start (or with `run_id`, resume) the W&B run; None when logger.wandb.mode=disabled."""
    if wandb_cfg.mode == "disabled":
        return None
    import wandb
    run = wandb.init(mode=wandb_cfg.mode, dir=str(run_dir), project=wandb_cfg.project, entity=wandb_cfg.entity,
                     name=wandb_cfg.name, tags=list(wandb_cfg.tags), config=config, id=run_id,
                     resume="allow" if run_id else None,
                     # The console goes to Hydra's train.log already; capturing it would garble the bar.
                     settings=wandb.Settings(console="off", quiet=True))
    if wandb_cfg.mode == "offline":
        log.info("W&B offline run %s in %s (upload: wandb sync %s)", run.id, run.dir, Path(run.dir).parent)
    return WandbRun(run)
