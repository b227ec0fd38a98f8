"""`torchrun --nproc-per-node 2 train.py ...` on the CPU (gloo): the job a user launches over several
processes trains as one process would on the same tokens, writes one run directory, stops every rank at
the same step when one rank gets SIGTERM, and its distributed checkpoint resumes exactly on 2 processes
and on 1, and exports as the one-process model."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from safetensors.torch import load_file

from scripts.export import export

from tests.jobs_support import FAST, REPO, TIMEOUT_S, losses, records, wait_for

ENV = os.environ | {"OMP_NUM_THREADS": "1"}
# Full fine-tuning of the tiny model (4 query heads per rank of 2, 2 KV heads) unless a test says lora. On a
# machine with GPUs (scripts/gpu_session.sh parallel_tests) the environment adds overrides (device=cuda, a
# model our kernels run) and the bf16 tolerance of one process against two.
JOB = [*FAST, *os.environ.get("LONGCTX_TORCHRUN_JOB", "").split()]
ONE_AGAINST_TWO_RTOL = float(os.environ.get("LONGCTX_TORCHRUN_RTOL", "1e-4"))
# The SIGTERM test's processes (gpu_session.sh parallel_tests_x4: 4 GPUs, resumed on 4 and on 2).
SIGTERM_PROCESSES = int(os.environ.get("LONGCTX_TORCHRUN_PROCESSES", "2"))


def torchrun(run_dir, *overrides: str, processes: int = 2) -> subprocess.Popen:
    """train.py under torchrun (one process: plain python, as a user resumes on one GPU), logging to
    <run_dir>.log."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
                if processes > 1 else [sys.executable])
    log = open(f"{run_dir}.log", "a")
    return subprocess.Popen([*launcher, "train.py", *JOB, f"output_dir={run_dir}", *overrides], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)


def finished(process: subprocess.Popen, run_dir, stopped: bool = False) -> None:
    """The job ended: with exit status 0, or, `stopped` by a signal, with torchrun's failure (each rank exits
    143, 128 + SIGTERM, so that a scheduler does not take the job for a finished one)."""
    try:
        code = process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        code = "timeout"
    log = open(f"{run_dir}.log").read()
    expected = code not in (0, "timeout") and "143" in log if stopped else code == 0
    assert expected, f"exit {code}:\n{log[-4000:]}"


def run(run_dir, *overrides: str, processes: int = 2) -> list[float]:
    finished(torchrun(run_dir, *overrides, processes=processes), run_dir)
    return losses(run_dir)


@pytest.mark.parametrize("train, parallel, single", [
    ("full", ["parallel.sequence=2"], []),
    ("lora", ["parallel.sequence=2"], []),
    # FSDP2: each rank holds half of every weight, gradient and AdamW moment.
    ("full", ["parallel.sequence=2", "parallel.shard=true"], []),
    # FSDP2 over LoRA: the frozen base and the adapters sharded.
    ("lora", ["parallel.sequence=2", "parallel.shard=true"], []),
    # Two data-parallel ranks of one sequence each equal one process accumulating both.
    ("full", ["parallel.sequence=1", "batch_size=1"], ["batch_size=1", "optim.grad_accum_steps=2"]),
    # bf16 weights and moments (stochastic rounding), gradients streamed to the host, sharded: data parallel, as
    # each rank's bf16 forward is then one process's (tests/test_sharded_full_finetune.py says why it is exact).
    ("full", ["train.full_state=bf16_host_grads", "parallel.sequence=1", "batch_size=1", "parallel.shard=true"],
     ["train.full_state=bf16_host_grads", "batch_size=1", "optim.grad_accum_steps=2"]),
], ids=["sequence-parallel-full", "sequence-parallel-lora", "sequence-parallel-sharded",
        "sequence-parallel-lora-sharded", "data-parallel-full", "data-parallel-sharded-bf16-host-grads"])
def test_two_processes_train_as_one_and_their_checkpoint_resumes_in_one(tmp_path, train, parallel, single):
    common = [f"train={train}", "max_steps=4", "checkpoint.every_steps=2"]
    two = run(tmp_path / "two", *common, *parallel)
    one = run(tmp_path / "one", *common, *single, processes=1)
    assert len(two) == len(one) == 4
    assert two == pytest.approx(one, rel=1e-5)
    step_2 = tmp_path / "two" / "checkpoints" / "step-2"
    assert (step_2 / "state" / ".metadata").is_file() and (step_2 / "COMPLETE").is_file()
    assert not any(tmp_path.joinpath("two", "checkpoints").glob(".tmp-*"))
    assert ("M parameters sharded" in (tmp_path / "two" / "train.log").read_text()) == (
        "parallel.shard=true" in parallel)
    # The 2-process checkpoint continued by one process (a new run directory: resume=<path>).
    resumed = run(tmp_path / "resumed", *common, *single, f"resume={step_2}", processes=1)
    assert resumed == pytest.approx(one[2:], rel=1e-5)
    # And the 1-process checkpoint by two (sharded: each rank takes its part of the whole tensors).
    resumed = run(tmp_path / "resumed-on-two", *common, *parallel,
                  f"resume={tmp_path / 'one' / 'checkpoints' / 'step-2'}")
    assert resumed == pytest.approx(one[2:], rel=1e-5)
    # Exported, the 2-process model is the 1-process one.
    exported = {name: load_file(export(tmp_path / name / "checkpoints" / "step-4", tmp_path / f"{name}-hf")
                                / "model.safetensors") for name in ("two", "one")}
    assert exported["two"].keys() == exported["one"].keys() and exported["one"]
    for name, weight in exported["one"].items():
        _assert_same_training(exported["two"][name], weight, name)


def _assert_same_training(two: torch.Tensor, one: torch.Tensor, name: str) -> None:
    """The same weights up to rounding, judged on the whole tensor: AdamW moves an element by a step of about
    the learning rate whatever its gradient's size, so the rounding of a small gradient (two ranks' sums
    against one process's) can move single elements apart. On torch 2.11 one element of 49,152 was 1.4e-5
    apart, 3e-6 of the tensor's norm; the bounds leave a margin of that measurement, not a derived one.
    Shards gathered wrongly are apart by the weights' size, an update lost by 1e-2 of the tensor in full
    fine-tuning and about 1e-3 with LoRA: both far past 1e-4. A tensor whose every element is close passes
    whatever its norm: a key projection's bias has no true gradient (softmax cancels a shift of a row's
    scores), so AdamW moves it from zero by rounding noise alone, a tensor of lr-sized values."""
    assert two.shape == one.shape and two.dtype == one.dtype, (name, two.shape, one.shape, two.dtype, one.dtype)
    two, one = two.double(), one.double()
    relative = float((two - one).norm() / one.norm())
    far = ~torch.isclose(two, one, rtol=1e-4, atol=1e-5)
    same = not far.any() or (relative <= 1e-4 and int(far.sum()) <= max(1, far.numel() // 1000))
    assert not two.isnan().any() and same, (
        f"{name}: |two - one| / |one| = {relative:.2e}; {int(far.sum())} of {far.numel()} elements apart: two "
        f"{two[far][:8].tolist()}, one {one[far][:8].tolist()}")


def _rank_process(torchrun_process: subprocess.Popen, rank: int) -> psutil.Process:
    def found():
        return [child for child in psutil.Process(torchrun_process.pid).children(recursive=True)
                if child.environ().get("RANK") == str(rank)]
    wait_for(found, f"rank {rank}'s process", torchrun_process)
    return found()[0]


def test_sigterm_to_one_rank_stops_both_at_one_step_and_resumes_exactly_on_two_and_on_one(tmp_path):
    """N = 2 processes (LONGCTX_TORCHRUN_PROCESSES: N): SIGTERM to one rank stops all at one step, resumed on N
    exactly and on N / 2 (one process for N = 2: the DCP state resharded) to the uninterrupted losses."""
    processes, fewer = SIGTERM_PROCESSES, SIGTERM_PROCESSES // 2
    steps = ["max_steps=40", f"parallel.sequence={processes}"]
    uninterrupted = run(tmp_path / "uninterrupted", *steps, processes=processes)
    stopped_dir = tmp_path / "stopped"
    process = torchrun(stopped_dir, *steps, processes=processes)
    rank_1 = _rank_process(process, 1)
    wait_for(lambda: len(records(stopped_dir)) >= 2, "two steps", process)
    rank_1.send_signal(signal.SIGTERM)
    finished(process, stopped_dir, stopped=True)
    stop = len(records(stopped_dir))
    assert stop < 40, "the job ended before the signal: nothing was tested"
    checkpoints = sorted(p.name for p in (stopped_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step-{stop}"]      # both ranks stopped after the same step and saved it together
    assert losses(stopped_dir) == uninterrupted[:stop]

    on_fewer = tmp_path / "on_fewer"
    shutil.copytree(stopped_dir, on_fewer)
    resumed_on_all = run(stopped_dir, *steps, processes=processes)
    assert resumed_on_all == uninterrupted     # exact: same ranks, same reductions
    resumed_on_fewer = run(on_fewer, "max_steps=40", f"parallel.sequence={fewer}", processes=fewer)
    assert resumed_on_fewer[:stop] == uninterrupted[:stop]
    assert resumed_on_fewer[stop:] == pytest.approx(uninterrupted[stop:], rel=ONE_AGAINST_TWO_RTOL)
