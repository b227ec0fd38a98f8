"""Hydra sweeps (`train.py -m`), as processes: each job in its own run directory under the sweep's output_dir,
holding its overrides; a failed job is one line and the others still run; the exit status says."""
import subprocess
import sys

import pytest
import yaml

from tests.jobs_support import FAST, REPO, records


def test_each_job_of_a_sweep_runs_in_its_own_directory_and_a_failed_one_hides_no_other(tmp_path):
    sweep = tmp_path / "sweep"
    fast = [override for override in FAST if not override.startswith("max_steps=")]
    result = subprocess.run([sys.executable, "train.py", "-m", *fast, f"output_dir={sweep}", "max_steps=0,2,3"],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    assert "sweep job #0 (" in output and "max_steps=0) failed: max_steps=0 must be at least 1" in output
    last = output.strip().splitlines()[-1]
    assert "sweep: 1 job(s) failed: #0 (device=cpu " in last and last.endswith(f"output_dir={sweep} max_steps=0)")
    for number, steps in ((1, 2), (2, 3)):
        job_dir = sweep / str(number)
        assert [r["step"] for r in records(job_dir)] == list(range(1, steps + 1))      # none resumed another
        assert yaml.safe_load((job_dir / "overrides.yaml").read_text())[-1] == f"max_steps={steps}"
        assert f"max_steps: {steps}" in (job_dir / "config.yaml").read_text()
    assert not (sweep / "0").exists() and (sweep / "multirun.yaml").is_file()     # refused before any write
    assert not (REPO / "multirun").exists()


def test_a_sweep_job_writes_its_overrides_only_once_it_holds_its_run_directory(tmp_path):
    from conf.validate import ConfigError
    from storage.lock import DirectoryLock
    from tests.jobs_support import job_config
    from trainer.loop import train
    (tmp_path / "overrides.yaml").write_text("- the running job's\n")
    holder = DirectoryLock(tmp_path / "run.lock")
    holder.acquire()        # a job still running there (another sweep process)
    try:
        with pytest.raises(ConfigError, match="is in use by another run"):
            train(job_config(tmp_path, "max_steps=2"), overrides=["max_steps=2"])
    finally:
        holder.release()
    assert (tmp_path / "overrides.yaml").read_text() == "- the running job's\n"
    train(job_config(tmp_path, "max_steps=2"), overrides=["max_steps=2"])
    assert yaml.safe_load((tmp_path / "overrides.yaml").read_text()) == ["max_steps=2"]
