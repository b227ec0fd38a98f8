"""The end of a run: one summary with the commands to plot and export, and scripts/report.py's figures
(accuracy when logged, the run directory in every title, no series that is zero throughout)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest

from scripts.report import figures
from tests.jobs_support import (FAST, REPO, TIMEOUT_S, job_config, records, single_torch_thread,  # noqa: F401
                                wait_for)
from trainer.console import shown_path
from trainer.loop import train


def test_a_finished_run_prints_one_summary_with_the_plot_and_export_commands(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer.console")
    final = train(job_config(tmp_path, "max_steps=3"))
    [summary] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finished")]
    assert summary.startswith("finished at step 3/3 (3 steps in this start): ")
    assert f"loss {final['loss']:.4f}, accuracy {final['accuracy']:.3f}, " in summary
    assert "tokens/s" in summary and f"checkpoints in {tmp_path / 'checkpoints'} (newest step-3)" in summary
    python = shown_path(sys.executable)
    assert f"\n  plot:    {python} {shown_path(REPO / 'scripts' / 'report.py')} {tmp_path}\n" in summary
    assert summary.endswith(f"\n  export:  {python} {shown_path(REPO / 'scripts' / 'export.py')} "
                            f"{tmp_path / 'checkpoints' / 'step-3'} <out dir>")


def test_the_printed_commands_run_as_printed_without_the_virtualenv_on_path(tmp_path, caplog):
    """The summary's plot and export commands name the interpreter that has the project's packages (a bare
    `python` on a fresh machine has no hydra or matplotlib), run from where the job was started."""
    caplog.set_level(logging.INFO, logger="trainer.console")
    run_dir = tmp_path / "run"
    train(job_config(run_dir, "max_steps=2"))
    [summary] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finished")]
    commands = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in summary.splitlines()[1:]}
    commands["export"] = commands["export"].replace("<out dir>", str(tmp_path / "exported"))
    for name, command in commands.items():
        result = subprocess.run(command, shell=True, cwd=os.getcwd(), capture_output=True, text=True, timeout=120,
                                env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, (name, command, result.stderr[-2000:])
    assert (run_dir / "report_loss.png").is_file() and (tmp_path / "exported" / "config.json").is_file()


def test_a_resumed_run_counts_only_its_own_steps(tmp_path, caplog):
    train(job_config(tmp_path, "max_steps=2"))
    caplog.set_level(logging.INFO, logger="trainer.console")
    train(job_config(tmp_path, "max_steps=3"))
    [summary] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finished")]
    assert summary.startswith("finished at step 3/3 (1 step in this start): ")


def test_the_run_log_is_closed_when_the_run_ends(tmp_path):
    train(job_config(tmp_path / "first", "max_steps=2"))
    logging.getLogger("after").warning("logged after the run")
    assert "logged after the run" not in (tmp_path / "first" / "train.log").read_text()
    assert not [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
                and str(tmp_path) in h.baseFilename]


def record(step: int, **values) -> dict:
    return {"step": step, "loss": 3.0 / step, "tokens_per_s": 100.0 * step, "host_rss_gib": 1.5,
            "offload/pinned_gib": 0.0, "offload/hidden_gib": None, **values}


@pytest.mark.parametrize("accuracy", [[0.0, 0.5, 1.0], [0.0, 0.0, 0.0], None])
def test_report_draws_accuracy_when_logged_titles_the_run_and_leaves_out_zero_series(tmp_path, accuracy):
    records = [record(step, **({"accuracy": accuracy[step - 1]} if accuracy else {})) for step in (1, 2, 3)]
    drawn = figures(records, tmp_path)
    plt.close("all")
    assert list(drawn) == ["report_loss.png", *(["report_accuracy.png"] if accuracy else []),
                           "report_throughput.png", "report_memory.png"]
    series = {}
    for name, figure in drawn.items():
        [axes] = figure.axes
        assert str(tmp_path) in axes.get_title(), name
        series[name] = {line.get_label(): list(line.get_ydata()) for line in axes.lines}
    assert series["report_loss.png"] == {"loss": [3.0, 1.5, 1.0]}
    assert series["report_memory.png"] == {"host_rss_gib": [1.5, 1.5, 1.5]}     # pinned 0 throughout: left out
    if accuracy:                                                              # zero is a result here
        assert series["report_accuracy.png"] == {"accuracy": accuracy}


def test_a_resumed_random_init_run_says_resumed_instead_of_warning_of_random_weights(tmp_path, caplog):
    train(job_config(tmp_path, "max_steps=2"))
    assert "RANDOM weights" in caplog.text
    caplog.clear()
    caplog.set_level(logging.INFO, logger="trainer.build")
    train(job_config(tmp_path, "max_steps=3"))
    assert "RANDOM" not in caplog.text
    assert "tiny is built from random init, then resumed from the checkpoint's weights" in caplog.text


def test_step_lines_without_a_terminal_carry_elapsed_time_and_eta(monkeypatch, caplog):
    """A batch job's log (no TTY, so no progress bar) says how long the run has taken and has left."""
    import trainer.console as console
    clock = iter([1000.0, 1090.0])      # the bar starts, then 90 s later step 13 of 40 (3 done since step 10)
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))
    bar = console.ProgressBar(first_step=10, max_steps=40, enabled=True)
    record = {"step": 13, "applied": True, "loss": 1.0, "grad_norm": 0.5, "lr": 1e-4, "tokens_per_s": 10.0,
              "host_rss_gib": 1.0}
    caplog.set_level(logging.INFO, logger="trainer.console")
    bar.write(bar.step_line(record))
    assert caplog.records[-1].getMessage().endswith(" elapsed 01:30 eta 13:30")     # 27 steps at 30 s
    bar.close()


def test_a_job_whose_working_directory_is_removed_while_it_runs_finishes_with_exit_0(tmp_path):
    """A scheduler's temporary working directory, removed under a running job: the end summary then shows
    absolute paths."""
    workdir, run_dir = tmp_path / "workdir", tmp_path / "run"
    workdir.mkdir()
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen([sys.executable, str(REPO / "train.py"), *FAST, f"output_dir={run_dir}",
                                "max_steps=40"], cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                               env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: records(run_dir), "the first step", job)
        job.send_signal(signal.SIGSTOP)     # held mid-run while its working directory goes
        assert records(run_dir)[-1]["step"] < 40
        workdir.rmdir()
        job.send_signal(signal.SIGCONT)
        assert job.wait(TIMEOUT_S) == 0, log_path.read_text()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    output = log_path.read_text()
    assert "finished at step 40/40" in output and "Traceback" not in output
    assert f"export:  {sys.executable} {REPO / 'scripts' / 'export.py'} {run_dir / 'checkpoints' / 'step-40'}" in output
