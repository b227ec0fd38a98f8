"""Two CPU processes over gloo, for tests of what several ranks do together."""
from __future__ import annotations

import contextlib
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def gloo_rank(rank: int, init_file: str, failures):
    """Inside a worker of run_two_ranks: this process as rank `rank` of the gloo group while open; an error
    is put in `failures` for the parent, which fails the test with it, and raised; the group is left after."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        yield
    except BaseException as error:
        failures.put(f"rank {rank}: {type(error).__name__}: {error}")
        raise
    finally:
        dist.destroy_process_group()


def run_two_ranks(worker, *args) -> None:
    """Run worker(rank, init_file, failures, *args) in 2 spawned processes; fails with what any rank put in
    `failures` (a queue) or with their exit codes. The worker calls dist.init_process_group("gloo",
    init_method=f"file://{init_file}", rank=rank, world_size=2)."""
    context = mp.get_context("spawn")
    failures = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as directory:
        processes = [context.Process(target=worker, args=(rank, os.path.join(directory, "init"), failures, *args))
                     for rank in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=120)
    messages = []
    while not failures.empty():
        messages.append(failures.get())
    assert not messages, "\n".join(messages)
    assert [process.exitcode for process in processes] == [0, 0]
