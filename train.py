"""Entry point: `python train.py [group=option ...] [key=value ...]` (Hydra overrides); `-m` sweeps, each job
in its own run directory <output_dir>/<job number>."""
import logging
import os
import sys
from pathlib import Path

from trainer.allocator import prefer_expandable_segments

prefer_expandable_segments()       # before torch (imported below) initializes CUDA

import hydra  # noqa: E402

from conf.schema import register_configs  # noqa: E402
from conf.validate import ConfigError, check_override_keys  # noqa: E402
from data.tokenize import DataError  # noqa: E402
from model.hf_checkpoint import HFCheckpointError  # noqa: E402
from trainer.architecture import given_model_keys  # noqa: E402
from trainer.checkpoint.disk_space import full_disk_line  # noqa: E402
from trainer.checkpoint.format import CheckpointError  # noqa: E402
from trainer.guard import BadStepsError  # noqa: E402
from trainer.loop import train  # noqa: E402
from trainer.signals import exit_status, stopped_at_once_on_signals  # noqa: E402

register_configs()
log = logging.getLogger("train")
# Errors whose message already says what is wrong and what to change: shown without a traceback.
USER_ERRORS = (ConfigError, DataError, HFCheckpointError, CheckpointError, BadStepsError)
# The jobs of this process's sweep that failed: "#<number> (<overrides>)".
FAILED_JOBS: list[str] = []


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    """A job stopped by a signal exits 128 + its number (130: SIGINT, 143: SIGTERM), as a shell reports a
    process ended by it: a scheduler then knows it did not finish (trainer.signals)."""
    job = sweep_job()
    if job is not None:
        run_sweep_job(cfg, *job)
        return
    try:
        last = train(cfg, command_line_keys())
    except USER_ERRORS as error:
        log.error("%s", error)
        sys.exit(2)
    except Exception as error:
        if (line := full_disk_line(error, Path(cfg.output_dir))) is None:
            raise
        log.error("%s", line)
        sys.exit(1)
    if "stopped_by" in last:
        sys.exit(exit_status(last["stopped_by"]))


def sweep_job() -> tuple[int, list[str]] | None:
    """(job number, overrides) of a job of a sweep (`-m`); None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return hydra_cfg.job.num, list(hydra_cfg.overrides.task)


def command_line_keys() -> set[str]:
    """The model settings this job's command line gives (a setting equal to the model group's is still the
    user's: with model.path it overrides or is checked)."""
    from hydra.core.hydra_config import HydraConfig
    return given_model_keys(list(HydraConfig.get().overrides.task))


def run_sweep_job(cfg, number: int, overrides: list[str]) -> None:
    """One job of a sweep in its own run directory, <output_dir>/<number> (a shared one would make each job
    resume the previous), holding its overrides (written by train() once it holds the directory). A failed
    job is logged and counted, and the sweep goes on to the next (the process's exit status says); a job
    stopped by a signal stops the sweep."""
    cfg.output_dir = os.path.join(cfg.output_dir, str(number))
    name = f"#{number} ({' '.join(overrides)})"
    try:
        last = train(cfg, command_line_keys(), overrides)
    except Exception as error:
        if isinstance(error, (*USER_ERRORS, OSError)):
            log.error("sweep job %s failed: %s", name, error)
        else:       # a bug or a crash of one job: its traceback, and the other jobs still run
            log.exception("sweep job %s failed", name)
        FAILED_JOBS.append(name)
        return
    if "stopped_by" in last:
        log.error("sweep job %s stopped by a signal: the sweep stops (run it again to continue each job)", name)
        sys.exit(exit_status(last["stopped_by"]))


def check_command_line() -> None:
    """A misspelt key in an override (`optim.learnig_rate=...`) stops with the nearest valid key, in one line,
    before Hydra (which would advise appending it with `+`)."""
    groups = {path.name for path in (Path(__file__).parent / "conf").iterdir() if path.is_dir()}
    try:
        check_override_keys(sys.argv[1:], groups)
    except ConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    check_command_line()
    with stopped_at_once_on_signals():
        main()
    if FAILED_JOBS:
        log.error("sweep: %d job(s) failed: %s", len(FAILED_JOBS), "; ".join(FAILED_JOBS))
        sys.exit(1)
