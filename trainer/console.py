"""What the terminal shows: a startup summary, a progress bar on interactive terminals, a log line every
`log_every` steps (which also lands in <run dir>/train.log), and a summary at the end."""
from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import time
from pathlib import Path

from tqdm import tqdm

from storage.atomic import disk_is_full
from trainer.metrics import METRICS_FILE, read_records

log = logging.getLogger(__name__)


RUN_LOG = "train.log"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_command(script: str, *arguments: str) -> str:
    """The command line that runs scripts/<script> as printed: with this interpreter (the virtualenv's, which
    has the project's packages; a bare `python` may lack them), each path relative to the working directory
    when under it."""
    return shlex.join([shown_path(sys.executable), shown_path(SCRIPTS / script), *map(str, arguments)])


def shown_path(path) -> str:
    """`path` (not resolved: a virtualenv's python is a link) relative to the working directory when under it,
    else absolute."""
    absolute = os.path.abspath(path)
    try:
        relative = os.path.relpath(absolute)
    except FileNotFoundError:       # the working directory is gone (a scheduler's temporary one): nothing is under it
        return absolute
    return absolute if relative.startswith("..") else relative


@contextlib.contextmanager
def logging_to_run_dir(run_dir: Path):
    """While open, the log also goes to <run_dir>/train.log, formatted as on the terminal (Hydra's own file
    log is off: conf/hydra/job_logging/console.yaml); yields the RunLog. The trainer opens it once the config is
    accepted and closes it when the run ends, however it ends, so later logging in the process stays out of the
    file."""
    root = logging.getLogger()
    handler = RunLog(run_dir / RUN_LOG)
    handler.setFormatter(next((h.formatter for h in root.handlers if h.formatter), None))
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        handler.close()


class RunLog(logging.FileHandler):
    """The log lines of a run for train.log, held in memory until keep() (the run may continue the run
    directory: a resume's checks passed), then written there: a run refused as it starts leaves train.log as
    it was."""

    def __init__(self, path: Path):
        super().__init__(path, delay=True)      # opened by the first line written
        self.held: list[logging.LogRecord] | None = []     # None once kept
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is not None:
            self.held.append(record)
        elif not self.failed:
            super().emit(record)

    def keep(self) -> None:
        """Write the lines held so far to train.log, and every later one as it comes."""
        held, self.held = self.held, None
        for record in held:
            self.emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """train.log cannot be written (a full disk): the log goes on on the terminal only, instead of a
        traceback there for every line. A full disk stops the job at its next write anyway, in one line
        (train.py); another error is said here once."""
        error = sys.exc_info()[1]
        self.failed = True
        with contextlib.suppress(OSError):
            self.close()
        if not disk_is_full(error):
            sys.stderr.write(f"{self.baseFilename} can no longer be written ({error}): the log goes on here only\n")


@contextlib.contextmanager
def quiet_rank(rank: int):
    """While open, a rank other than 0 of a job over several processes shows only warnings and errors,
    each naming the rank: rank 0 shows the job."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    naming = RankPrefix(rank)
    root.setLevel(logging.WARNING)
    for handler in handlers:    # a handler's filter sees the records of every logger; the root's would not
        handler.addFilter(naming)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(naming)
        root.setLevel(level)


class RankPrefix(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.prefix = f"[rank {rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            record.msg = self.prefix + str(record.msg)
        return True


def startup_summary(lines: dict[str, str]) -> None:
    width = max(map(len, lines))
    log.info("job\n" + "\n".join(f"  {name:<{width}}  {value}" for name, value in lines.items()))


def memory_text(record: dict) -> str:
    if record.get("gpu_peak_gib") is not None:
        return f"gpu peak {record['gpu_peak_gib']:.1f}G"
    return f"rss {record['host_rss_gib']:.1f}G"


def step_line(record: dict, max_steps: int) -> str:
    if record["applied"]:
        loss = f"loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f}"
    else:
        loss = "update skipped: loss or gradients NaN/Inf"
    accuracy = "" if record.get("accuracy") is None else f" acc {record['accuracy']:.3f}"
    mfu = "" if record.get("mfu") is None else f" mfu {100 * record['mfu']:.1f}%"
    if record.get("mfu_measured_ceiling") is not None:
        mfu += f" (measured ceiling {100 * record['mfu_measured_ceiling']:.1f}%)"
    return (f"step {record['step']}/{max_steps} {loss}{accuracy} lr {record['lr']:.2e} "
            f"tok/s {record['tokens_per_s']:.0f}{mfu} {memory_text(record)}")


class ProgressBar:
    """tqdm bar with ETA, tokens/s, loss and memory; silent unless stderr is a terminal. Its step lines carry
    the elapsed time and ETA too, for logs without a terminal (batch jobs, train.log)."""

    def __init__(self, first_step: int, max_steps: int, enabled: bool):
        self.bar = tqdm(total=max_steps, initial=first_step, unit="step", dynamic_ncols=True,
                        disable=not (enabled and sys.stderr.isatty()))
        self.first_step, self.max_steps, self.started = first_step, max_steps, time.monotonic()

    def step_line(self, record: dict) -> str:
        """step_line, with the time since this start and the time left at this start's pace."""
        elapsed = time.monotonic() - self.started
        done = record["step"] - self.first_step
        left = elapsed / done * (self.max_steps - record["step"]) if done > 0 else None
        eta = "?" if left is None else tqdm.format_interval(left)
        return f"{step_line(record, self.max_steps)} elapsed {tqdm.format_interval(elapsed)} eta {eta}"

    def restart_clock(self) -> None:
        """Time this start from now: work before the first step (the evaluation at start) would otherwise
        count as the steps' and inflate the early ETAs."""
        self.started = time.monotonic()
        self.bar.unpause()

    def update(self, record: dict) -> None:
        loss = "nan" if record.get("loss") is None else f"{record['loss']:.4f}"
        self.bar.set_postfix_str(f"loss {loss} tok/s {record['tokens_per_s']:.0f} {memory_text(record)}",
                                 refresh=False)
        self.bar.update(1)

    def write(self, line: str) -> None:
        """A log line that does not tear the bar."""
        if self.bar.disable:
            log.info(line)
        else:
            self.bar.clear()
            log.info(line)
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def end_summary(run_dir: Path, first_step: int, max_steps: int, checkpoint: Path | None) -> None:
    """One summary when a run ends, finished or stopped by a signal: the steps of this start, the final loss
    and accuracy, tokens/s over this start, where the checkpoints are, and the commands to plot and export."""
    metrics = run_dir / METRICS_FILE
    steps = [r for r in read_records(metrics) if r["step"] > first_step] if metrics.is_file() else []
    last_step = steps[-1]["step"] if steps else first_step
    text = (f"{'finished' if last_step >= max_steps else 'stopped'} at step {last_step}/{max_steps} "
            f"({len(steps)} step{'' if len(steps) == 1 else 's'} in this start)")
    if steps:
        text += f": {final_values(steps)}"
    text += f"; checkpoints in {checkpoint.parent} (newest {checkpoint.name})" if checkpoint else "; no checkpoint"
    text += f"\n  plot:    {script_command('report.py', run_dir)}"
    if checkpoint:
        text += f"\n  export:  {script_command('export.py', checkpoint)} <out dir>"
    log.info(text)


def final_values(steps: list[dict]) -> str:
    """Loss and accuracy of the last step (accuracy when measured), and tokens/s over all of `steps`."""
    last = steps[-1]
    loss = "n/a (skipped step)" if last.get("loss") is None else f"{last['loss']:.4f}"
    accuracy = "" if last.get("accuracy") is None else f", accuracy {last['accuracy']:.3f}"
    seconds = sum(r["step_time_s"] for r in steps)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in steps)
    return f"loss {loss}{accuracy}, {tokens / seconds:,.0f} tokens/s"
