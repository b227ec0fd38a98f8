"""trainer.distributed.World over 2 gloo processes: a failure of what rank 0 alone does reaches every rank,
and the reductions every rank plans with agree; a rank's GPU, or a clear error where the machine has too few."""
from __future__ import annotations

import pytest
import torch

from conf.validate import ConfigError
from tests.gloo_support import gloo_rank, run_two_ranks
from trainer.distributed import MainRankFailed, World, rank_device, world_of


def _disk_full():
    raise OSError(28, "No space left on device")


def _worker(rank: int, init_file: str, failures):
    with gloo_rank(rank, init_file, failures):
        world = world_of(rank, 2, 1)
        written = []
        world.on_main(lambda: written.append(rank))
        assert written == ([0] if rank == 0 else [])
        try:
            world.on_main(_disk_full)
        except OSError as error:
            assert rank == 0 and error.errno == 28
        except MainRankFailed as error:
            assert rank == 1 and "rank 0 failed, so rank 1 stops too: OSError" in str(error)
            assert "No space left on device" in str(error)
        else:
            raise AssertionError("rank 0's failure did not reach this rank")
        assert world.min({"gpu": 80.0 - rank, "host": 100.0 + rank}) == {"gpu": 79.0, "host": 100.0}
        assert world.max({"gpu": 80.0 - rank}) == {"gpu": 80.0}
        assert world.gather(f"state of {rank}") == ["state of 0", "state of 1"]


def test_rank_zeros_failure_reaches_every_rank_and_reductions_agree():
    run_two_ranks(_worker)


def test_one_process_runs_the_action_and_raises_its_error():
    world, ran = World.single(), []
    world.on_main(lambda: ran.append(True))
    assert ran == [True]
    with pytest.raises(OSError, match="No space"):
        world.on_main(_disk_full)


def test_each_rank_gets_its_own_gpu_generator_back(monkeypatch, caplog):
    """The checkpoint holds every rank's GPU generator (the writing rank sees only its own GPU's advance);
    on the same world size rank r gets state r, on another none is restored, with a warning."""
    import torch
    from trainer.checkpoint.rng_state import capture_rng_state, restore_rng_state
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [])
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    by_rank = [torch.tensor([0], dtype=torch.uint8), torch.tensor([1], dtype=torch.uint8)]
    state = capture_rng_state(by_rank)
    restore_rng_state(state, rank=1, world_size=2)
    assert restored == [by_rank[1]]
    restore_rng_state(state, rank=0, world_size=1)
    assert restored == [by_rank[1]] and "GPU RNG states of 2 processes, this job runs 1" in caplog.text


def test_more_processes_than_gpus_on_a_machine_is_a_clear_error(monkeypatch):
    """torchrun --nproc-per-node=2 on a one-GPU machine: the second rank is told what to change, not CUDA's
    "invalid device ordinal"."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert rank_device(torch.device("cuda")) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"started 2 processes on this machine, which has 1 GPU\(s\).*"
                                          r"--nproc-per-node=1.*device=cpu"):
        rank_device(torch.device("cuda"))
    assert rank_device(torch.device("cpu")) == torch.device("cpu")
