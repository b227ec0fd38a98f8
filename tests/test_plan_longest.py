"""scripts/plan.py --longest: the longest seq_len that fits on N GPUs, LoRA and full fine-tuning, in one table."""
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from conf.errors import ConfigError
from conf.schema.memory import resolve_gpu_preset
from offload.plan import longest_fitting
from scripts.plan import LongestOptions, cell_config, format_table, longest_table, take_longest_options
from trainer.build import plan_for

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda")
# The Llama-3 8B shape with two layers, on the H100 80GB and a 125 GiB host: the table's numbers are the
# real model's kinds of bytes, and a cell's search stays short.
SMALL_LLAMA = ["model=llama3_8b", "model.num_hidden_layers=2", "memory.gpu=h100_80gb", "memory.host_memory_gib=125"]


def job_config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    resolve_gpu_preset(cfg.memory)
    return cfg


@pytest.fixture(scope="module")
def small_llama_table():
    cfg = job_config(*SMALL_LLAMA)
    with pytest.MonkeyPatch.context() as env:
        env.delenv("LOCAL_WORLD_SIZE", raising=False)
        env.delenv("WORLD_SIZE", raising=False)
        return cfg, longest_table(cfg, CUDA, LongestOptions(gpus=(1, 2, 4, 8)))


def test_each_cell_is_a_boundary_of_the_planner_it_fits_and_one_step_longer_does_not(small_llama_table):
    cfg, rows = small_llama_table
    assert [row["lora"].gpus for row in rows] == [1, 2, 4, 8]
    for row in rows:
        for mode, cell in row.items():
            assert cell.refused is None and cell.seq_len, f"{mode} on {cell.gpus} GPUs: {cell.describe()}"
            assert cell.seq_len % 1024 == 0 and cell.step == 1024

            def plan(seq_len, cell=cell, mode=mode):
                return plan_for(cell_config(cfg, cell.gpus, mode, cell.shard, seq_len), CUDA, cell.gpus,
                                world=cell.gpus)
            at, beyond = plan(cell.seq_len), plan(cell.seq_len + cell.step)
            assert at.fits and not beyond.fits, f"{mode} on {cell.gpus} GPUs at {cell.seq_len}"
            assert (cell.plan.gpu_peak, cell.plan.host_peak) == (at.gpu_peak, at.host_peak)
            assert at.capacity.host == 125 * 2**30 // cell.gpus          # the machine's host, shared by its ranks
            if not cell.shard and cell.gpus > 1:        # sharding, planned too, fits no longer
                sharded = plan_for(cell_config(cfg, cell.gpus, mode, True, cell.seq_len + cell.step), CUDA,
                                   cell.gpus, world=cell.gpus)
                assert not sharded.fits


def test_more_gpus_never_give_a_shorter_lora_sequence(small_llama_table):
    _, rows = small_llama_table
    lengths = [row["lora"].seq_len for row in rows]
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0], lengths


def test_full_fine_tuning_over_several_gpus_plans_the_bf16_states_sharded(small_llama_table):
    """The bf16 layouts fit longer than fp32; over several GPUs the trainer runs them only sharded."""
    _, rows = small_llama_table
    assert rows[0]["full"].plan.full_state != "fp32"
    assert all(row["full"].shard and row["full"].plan.full_state != "fp32" for row in rows[1:])


def test_the_table_prints_each_cells_length_and_peaks(small_llama_table):
    cfg, rows = small_llama_table
    table = format_table(cfg, CUDA, rows)
    assert "memory.gpu=h100_80gb, 79.2 GiB a GPU, 125 GiB of host memory a machine" in table
    cell = rows[3]["lora"]
    assert (f"| 8 | {cell.seq_len:,} (GPU {cell.plan.gpu_peak / 2**30:.2f}, host {cell.plan.host_peak / 2**30:.2f} "
            f"GiB" in table)


def test_a_cell_that_fits_at_no_length_says_why_with_the_numbers():
    """A 12 GiB GPU holds the two-layer model's LoRA base but not its full fine-tuning state in any layout,
    sharded or not: those cells name the GPU peak of the shortest length against what is usable."""
    cfg = job_config("model=llama3_8b", "model.num_hidden_layers=2", "memory.gpu_memory_gib=12",
                     "memory.host_memory_gib=125")
    row = longest_table(cfg, CUDA, LongestOptions(gpus=(2,)))[0]
    assert row["lora"].seq_len
    full = row["full"]
    assert full.seq_len is None and not full.plan.fits and full.plan.shape.tokens == 1024 // 2
    largest = max(full.plan.gpu, key=full.plan.gpu.get)
    assert largest in ("fp32 weights+grads+adam", "FSDP gathered weights+grads")
    sharded = " (parallel.shard=true)" * full.shard
    assert full.describe() == (f"nothing fits{sharded}: at 1,024 tokens the GPU peak is "
                               f"{full.plan.gpu_peak / 2**30:.2f} GiB of {full.plan.capacity.gpu_limit / 2**30:.2f} "
                               f"usable ({largest} {full.plan.gpu[largest] / 2**30:.2f})")


def test_a_configuration_the_checks_refuse_says_so_in_its_cell():
    cfg = job_config("model=llama3_8b", "model.num_hidden_layers=2", "memory.gpu=h100_80gb",
                     "train.full_state=bf16")
    row = longest_table(cfg, CUDA, LongestOptions(gpus=(3,)))[0]
    assert row["lora"].describe().startswith("cannot run: parallel.sequence=3 shards attention heads")
    row = longest_table(cfg, CUDA, LongestOptions(gpus=(2,)))[0]       # refused unsharded, run sharded
    assert row["full"].shard and row["full"].plan.full_state == "bf16" and row["full"].seq_len


def fits_below(limit: int, made: list[int]):
    def plan_at(length: int):
        made.append(length)
        return SimpleNamespace(fits=length <= limit)
    return plan_at


@pytest.mark.parametrize("start", [None, 1024, 40960, 41984, 43008, 1 << 30])
def test_the_search_finds_the_boundary_from_any_start(start):
    made = []
    length, plan = longest_fitting(fits_below(41_000, made), 1024, start=start)
    assert length == 40960 and plan.fits and 41984 in made
    if start in (40960, 41984):          # a guess at the boundary: the exact search costs two plans
        assert sorted(made) == [40960, 41984]


def test_the_search_below_a_length_and_where_nothing_fits():
    made = []
    assert longest_fitting(fits_below(41_000, made), 1024, below=20481)[0] == 20480
    assert max(made) <= 20480
    assert longest_fitting(fits_below(1000, []), 1024) is None
    assert longest_fitting(fits_below(1000, []), 1024, below=5000) is None


def test_the_options_come_out_of_the_command_line_and_the_overrides_stay():
    argv = ["plan.py", "model=llama3_8b", "--longest", "--gpus", "1", "2", "seq_len=8", "--step", "512", "-m"]
    assert take_longest_options(argv) == LongestOptions(gpus=(1, 2), step=512)
    assert argv == ["plan.py", "model=llama3_8b", "seq_len=8", "-m"]
    argv = ["plan.py", "model=llama3_8b"]
    assert take_longest_options(argv) is None and argv == ["plan.py", "model=llama3_8b"]


def run_plan_script(*args: str) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    return subprocess.run([sys.executable, str(ROOT / "scripts/plan.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=env)


def test_the_script_prints_the_table(small_llama_table):
    _, rows = small_llama_table
    result = run_plan_script("--longest", "--gpus", "1", "2", *SMALL_LLAMA, "device=cuda")
    assert result.returncode == 0, result.stderr
    printed = re.findall(r"^\| (\d) \| ([\d,]+) \(.*\| ([\d,]+) \(", result.stdout, re.MULTILINE)
    assert printed == [(str(row["lora"].gpus), f"{row['lora'].seq_len:,}", f"{row['full'].seq_len:,}")
                       for row in rows[:2]], result.stdout


def test_bad_table_options_are_named_and_the_script_exits_2():
    with pytest.raises(ConfigError, match="^--gpus 0 --step 1024: each must be at least 1$"):
        take_longest_options(["plan.py", "--longest", "--gpus", "0"])
    result = run_plan_script("--gpus", "2", "model=llama3_8b")
    assert result.returncode == 2, result.stderr
    assert "cannot plan: --gpus 2 shapes the --longest table: add --longest" in result.stderr
