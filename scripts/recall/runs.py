"""The train.py processes of scripts/recall_curve.py: run one after the other or at once, the warm start
trained and exported, and the runs an earlier call left read back for --redraw."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from scripts.recall.job import REFERENCE, REPO, WARM_START_MODEL, run_overrides, train_command
from trainer.metrics import METRICS_FILE, read_records


def run_result(name: str, code: int, wall_s: float, log: str, run_dir: Path) -> dict:
    """A finished run as report() takes it: its exit status, wall time and metrics records."""
    metrics = Path(run_dir) / METRICS_FILE
    return {"name": name, "exit": code, "wall_s": wall_s, "log": str(log), "run_dir": str(run_dir),
            "records": read_records(metrics) if metrics.is_file() else []}


def start_job(name: str, command: list[str], run_dir: Path, env: dict) -> dict:
    """Start one train.py process; its console output goes to <run_root>/<name>.log."""
    log_path = run_dir.parent / f"{name}.log"
    print(f"[{name}] {' '.join(command[1:])}", flush=True)
    with open(log_path, "w") as log:   # the child keeps its own descriptor
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    return {"name": name, "process": process, "started": time.perf_counter(), "log": str(log_path),
            "run_dir": str(run_dir)}


def finish_job(job: dict) -> dict:
    """Wait for a started job; its exit status, wall time and metrics records."""
    code = job["process"].wait()
    wall = time.perf_counter() - job["started"]
    print(f"[{job['name']}] exit {code} after {wall:.0f} s (log {job['log']})", flush=True)
    if code != 0:
        print(Path(job["log"]).read_text(errors="replace")[-3000:], flush=True)
    return run_result(job["name"], code, wall, job["log"], job["run_dir"])


def run_jobs(commands: dict[str, tuple[list[str], Path]], env: dict, concurrent: bool) -> dict[str, dict]:
    """Run each (command, run_dir) one after the other, or all at once; a job still running when this
    stops early (an error, Ctrl-C) is terminated rather than left holding the GPU."""
    jobs, runs = {}, {}
    try:
        for name, (command, run_dir) in commands.items():
            jobs[name] = start_job(name, command, run_dir, env)
            if not concurrent:
                runs[name] = finish_job(jobs[name])
        for name in commands:
            if name not in runs:
                runs[name] = finish_job(jobs[name])
    finally:
        for job in jobs.values():
            if job["process"].poll() is None:
                job["process"].terminate()
                try:
                    job["process"].wait(timeout=30)
                except subprocess.TimeoutExpired:
                    job["process"].kill()
    return runs


def warm_start(args, root: Path, env: dict) -> tuple[Path, dict]:
    """Train the model args.warm_start_steps steps at args.warm_start_len tokens on the reference path, save
    that step and export it as a Hugging Face directory that both long runs load (model.path). Returns the
    directory and the finished job."""
    steps, length = args.warm_start_steps, args.warm_start_len
    run_dir = root / "warm_start"
    command = train_command(args, *REFERENCE, run_dir, run_overrides(args, length, steps, checkpoint_every=steps))
    job = run_jobs({"warm_start": (command, run_dir)}, env, concurrent=False)["warm_start"]
    if job["exit"] != 0:
        raise SystemExit(f"the warm start failed (exit {job['exit']}): {job['log']}")
    model_dir = root / WARM_START_MODEL
    export = subprocess.run([sys.executable, "scripts/export.py", str(run_dir / "checkpoints" / f"step-{steps}"),
                             str(model_dir)], cwd=REPO, env=env, capture_output=True, text=True)
    if export.returncode != 0:
        raise SystemExit(f"exporting the warm start failed:\n{export.stdout[-2000:]}{export.stderr[-2000:]}")
    return model_dir, job


def finished_runs(root: Path, args, names) -> tuple[dict[str, dict], dict | None]:
    """The runs `names` (and warm start) under an earlier run root, as run_jobs returns them; a run counts as
    finished (exit 0) when its metrics have every step (--steps, --warm-start-steps)."""
    def finished(name: str, steps: int) -> dict:
        run = run_result(name, 0, float("nan"), root / f"{name}.log", root / name)
        return run | {"exit": 0 if len(run["records"]) == steps else 1}
    warm = finished("warm_start", args.warm_start_steps) if (root / "warm_start").is_dir() else None
    return {name: finished(name, args.steps) for name in names}, warm
