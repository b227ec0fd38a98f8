"""Print the memory plan of a config: `.venv/bin/python scripts/plan.py model=llama3_8b train=lora seq_len=524288`.

Plans for the GPU and host of this machine. Elsewhere name the target GPU, `memory.gpu=a100_80gb|h100_80gb|
h200`, or give its size, `memory.gpu_memory_gib=79.2`, and the host's, `memory.host_memory_gib=125`; on a
machine without a GPU the plan is for an H100 80GB on a 125 GiB host unless told otherwise (it says so).
Several GPUs: `parallel.sequence=8` plans one of 8 sequence-parallel ranks; WORLD_SIZE=N (as torchrun sets
it) plans one of N ranks (data parallel beyond the sequence degree; `parallel.shard=true` shards full
fine-tuning over all N). The ranks share one host unless LOCAL_WORLD_SIZE (the ranks per machine) says otherwise.
Exits 1 when the plan does not fit, 2 when it cannot be made (the message names the setting to give).

`--longest [--gpus 1 2 4 8] [--step 1024]` prints instead the longest seq_len that fits on each number of GPUs,
LoRA and full fine-tuning, in one table: each row plans one rank of N as `torchrun --nproc-per-node N` would
run it with parallel.sequence=N, the machine's host memory shared by its ranks (LOCAL_WORLD_SIZE per machine
where given), with and without parallel.shard (the longer is shown; WORLD_SIZE, parallel.sequence and
parallel.shard given are not read); lengths are multiples of --step and of N.
"""
import argparse
import copy
import functools
import itertools
import math
import os
import sys
from dataclasses import dataclass

import hydra
import torch

from conf.errors import ConfigError
from conf.schema import JobConfig, register_configs
from conf.schema.memory import PLANNING_GPU, PLANNING_HOST_GIB, check_memory, resolve_gpu_preset
from conf.schema.train import check_fp8, check_train
from conf.schema.parallel import check_parallel, world_size
from conf.validate import check_finite_numbers, check_known_keys
from offload.byte_model import Capacity
from offload.placement import rebuilding_keeps
from offload.plan import MemoryPlan, longest_fitting
from offload.store import Placement
from offload.units import GIB
from trainer.build import plan_for

register_configs()
# The --longest table asked for (take_longest_options), read by main: Hydra's entry takes only the config.
LONGEST = None


@dataclass(frozen=True)
class LongestOptions:
    """The `--longest` table asked for on the command line: its GPU counts and the step of its lengths."""
    gpus: tuple[int, ...] = (1, 2, 4, 8)
    step: int = 1024


@dataclass
class Longest:
    """One cell of the table: the longest seq_len that fits on `gpus` GPUs (None: none does), with its plan (or
    the plan of the shortest length tried, which does not fit), or why the configuration cannot run at all."""
    gpus: int
    mode: str
    step: int
    seq_len: int | None = None
    plan: MemoryPlan | None = None
    shard: bool = False
    refused: str | None = None

    def describe(self) -> str:
        if self.refused:
            return f"cannot run: {self.refused}"
        if self.seq_len is None:
            sharded = " (parallel.shard=true)" * self.shard
            return f"nothing fits{sharded}: at {self.step:,} tokens {shortfall(self.plan)}"
        settings = ([f"full_state={self.plan.full_state}"] * (self.mode == "full")
                    + ["parallel.shard=true"] * self.shard)
        return (f"{self.seq_len:,} ({self.plan.device_label} {self.plan.gpu_peak / GIB:.2f}, host "
                f"{self.plan.host_peak / GIB:.2f} GiB" + "".join(f"; {s}" for s in settings) + ")")

    def reach(self) -> tuple[int, float]:
        """What orders the cells of one count of GPUs: the longer, else (none fits) the smaller shortest plan."""
        return (self.seq_len, 0) if self.seq_len else (0, -self.plan.gpu_peak)


def shortfall(plan: MemoryPlan) -> str:
    """One line: what a plan that does not fit needs against what there is, with its largest item."""
    needs = []
    for title, items, limit in ((plan.device_label, plan.gpu, plan.capacity.gpu_limit),
                                ("host", plan.host, plan.capacity.host)):
        if sum(items.values()) > limit:
            name, size = max(items.items(), key=lambda item: item[1])
            needs.append(f"the {title} peak is {sum(items.values()) / GIB:.2f} GiB of {limit / GIB:.2f} usable "
                         f"({name} {size / GIB:.2f})")
    if plan.pinned > plan.capacity.pinnable:
        needs.append(f"{plan.pinned / GIB:.2f} GiB pinned of {plan.capacity.pinnable / GIB:.2f} pinnable")
    return "; ".join(needs)


def longest_cell(cfg, device: torch.device, gpus: int, mode: str, step: int, per_machine: int | None,
                 guess: int | None = None) -> Longest:
    """The longest seq_len of train=`mode` on `gpus` GPUs: one rank of them, parallel.sequence=gpus, with
    parallel.shard off, and on where the checks let it run and it fits longer. `guess`: where the search
    starts (the length of fewer GPUs)."""
    step = math.lcm(step, gpus)
    per_host = min(gpus, per_machine or gpus)
    best, refusal = None, None
    for shard in (False, True) if gpus > 1 else (False,):
        cell = cell_config(cfg, gpus, mode, shard, step)
        try:
            check_parallel(cell, world=gpus)
            check_fp8(cell)
        except ConfigError as error:
            refusal = refusal or str(error)
            continue

        @functools.cache
        def plan_at(seq_len: int, cell=cell) -> MemoryPlan:
            cell.seq_len = seq_len
            return plan_for(cell, device, per_host, world=gpus, with_advice=False)
        if best and best.seq_len and not plan_at(best.seq_len + step).fits:       # sharded, no longer
            continue
        found = longest_fitting(plan_at, step, start=quick_guess(
            cell, device, per_host, step, best.seq_len + step if best and best.seq_len else guess))
        candidate = (Longest(gpus, mode, step, *found, shard) if found else
                     Longest(gpus, mode, step, plan=plan_at(step), shard=shard))
        if best is None or candidate.reach() > best.reach():
            best = candidate
    return best or Longest(gpus, mode, step, refused=refusal)


def cell_config(cfg, gpus: int, mode: str, shard: bool, seq_len: int):
    """`cfg` as a cell of the table runs it: train=`mode` on `gpus` GPUs, one sequence over all of them."""
    cell = copy.deepcopy(cfg)
    cell.train.mode, cell.parallel.sequence, cell.parallel.shard, cell.seq_len = mode, gpus, shard, seq_len
    return cell


def quick_guess(cell, device: torch.device, per_host: int, step: int, guess: int | None) -> int | None:
    """Where the exact search of `cell`'s longest length starts: the longest of a quicker plan, the same keeping
    no attention outputs (memory.kept_attention_layers=0 where the planner would choose), which fits about
    the same lengths; searched from `guess`."""
    quick = copy.deepcopy(cell)
    if quick.memory.kept_attention_layers is None:
        quick.memory.kept_attention_layers = 0

    def plan_at(seq_len: int) -> MemoryPlan:
        quick.seq_len = seq_len
        return plan_for(quick, device, per_host, world=cell.parallel.sequence, with_advice=False)
    found = longest_fitting(plan_at, step, start=guess and max(step, guess - guess % step))
    return found and found[0]


def longest_table(cfg, device: torch.device, options: LongestOptions) -> list[dict[str, Longest]]:
    """For each GPU count of `options`, the LoRA and the full fine-tuning cell (longest_cell), each searched
    from the row before's length."""
    per_machine = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    rows = []
    for gpus in options.gpus:
        rows.append({mode: longest_cell(cfg, device, gpus, mode, options.step, per_machine,
                                        rows[-1][mode].seq_len if rows else None) for mode in ("lora", "full")})
    return rows


def format_table(cfg, device: torch.device, rows: list[dict[str, Longest]]) -> str:
    """The table as markdown, under a line saying what was planned for."""
    machine = Capacity.detect(device, cfg.memory)
    gpu = f"memory.gpu={cfg.memory.gpu}, " if cfg.memory.gpu else ""
    per_machine = os.environ.get("LOCAL_WORLD_SIZE")
    ranks = f"N, at most LOCAL_WORLD_SIZE={per_machine}" if per_machine else "N"
    batch = f", batch_size={cfg.batch_size}" if cfg.batch_size != 1 else ""
    lines = [f"longest seq_len that fits (planner figures, not measurements): model={cfg.model.name}{batch}, {gpu}"
             f"{machine.gpu / GIB:g} GiB a {'GPU' if device.type == 'cuda' else 'device (the host)'}, "
             f"{machine.host / GIB:g} GiB of host memory a machine shared by its ranks ({ranks}); "
             f"parallel.sequence=N; peaks per rank",
             "| GPUs | LoRA | full fine-tuning |", "| --- | --- | --- |"]
    lines += [f"| {row['lora'].gpus} | {row['lora'].describe()} | {row['full'].describe()} |" for row in rows]
    return "\n".join(lines)


def take_longest_options(argv: list[str]) -> LongestOptions | None:
    """`--longest [--gpus N ...] [--step T]` taken out of `argv`, which keeps the rest (Hydra's); None without
    --longest. --gpus takes the numbers after it, up to the first override."""
    ours, rest, at = [], argv[:1], 1
    while at < len(argv):
        arg = argv[at]
        at += 1
        if arg not in ("--longest", "--gpus", "--step"):
            rest.append(arg)
            continue
        taken = (list(itertools.takewhile(lambda value: value.lstrip("-").isdigit(), argv[at:])) if arg == "--gpus"
                 else argv[at:at + (arg == "--step")])
        ours += [arg, *taken]
        at += len(taken)
    parser = argparse.ArgumentParser(prog="scripts/plan.py", add_help=False)
    parser.add_argument("--longest", action="store_true")
    parser.add_argument("--gpus", type=int, nargs="+", default=list(LongestOptions.gpus))
    parser.add_argument("--step", type=int, default=LongestOptions.step)
    options = parser.parse_args(ours)
    argv[:] = rest
    if ours and not options.longest:
        raise ConfigError(f"{' '.join(ours)} shapes the --longest table: add --longest")
    if min(options.gpus) < 1 or options.step < 1:
        raise ConfigError(f"--gpus {' '.join(map(str, options.gpus))} --step {options.step}: each must be at least 1")
    return LongestOptions(tuple(options.gpus), options.step) if options.longest else None


def plan_without_a_gpu(memory_cfg) -> str:
    """No CUDA GPU is visible: plan for the named GPU, else PLANNING_GPU, and a host of the given size, else
    PLANNING_HOST_GIB (this machine's is no guide to the target's). Returns the line saying so."""
    if memory_cfg.gpu is None and memory_cfg.gpu_memory_gib is None:
        memory_cfg.gpu = PLANNING_GPU
    if memory_cfg.host_memory_gib is None:
        memory_cfg.host_memory_gib = PLANNING_HOST_GIB
    resolve_gpu_preset(memory_cfg)
    gpu = f"memory.gpu={memory_cfg.gpu} " if memory_cfg.gpu else ""
    return (f"no CUDA GPU is visible: planning for {gpu}({memory_cfg.gpu_memory_gib:g} GiB) on a host of "
            f"{memory_cfg.host_memory_gib:g} GiB (memory.gpu=, memory.gpu_memory_gib=, memory.host_memory_gib= "
            f"to change)")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg) -> None:
    device = torch.device("cpu" if cfg.device == "cpu" else "cuda")
    try:
        check_known_keys(cfg)
        check_finite_numbers(cfg, JobConfig)
        check_memory(cfg.memory)     # the plan is for a target machine: only its memory settings are checked,
        check_train(cfg.train)       # and what is trained
        check_fp8(cfg)
        if device.type == "cuda" and not torch.cuda.is_available():
            print(plan_without_a_gpu(cfg.memory))
        resolve_gpu_preset(cfg.memory)
        if LONGEST:
            print(format_table(cfg, device, longest_table(cfg, device, LONGEST)))
            return
        world = max(world_size(), cfg.parallel.sequence)
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world > 1:
            print(f"planning one rank of {world} (WORLD_SIZE=), {cfg.parallel.sequence} per sequence, {per_host} "
                  f"per host sharing its memory (LOCAL_WORLD_SIZE=)")
        plan = plan_for(cfg, device, per_host)
    except ValueError as error:   # bad settings (ConfigError), or a checkpoint's config.json that cannot be read
        print(f"cannot plan: {error}", file=sys.stderr)
        sys.exit(2)
    print(plan.describe() if plan.fits else plan.failure())
    if plan.placements is not None:
        full = " f=full: every activation kept" if Placement.FULL in plan.placements else ""
        embedding = " e=looked up from the embedding" if Placement.EMBEDDING in plan.placements else ""
        print("layer inputs:     ", " ".join(p[0] for p in plan.placements),
              f"(g=gpu h=host r=recomputed{full}{embedding})")
        rebuilt = [rebuilding_keeps(plan.shape, plan.placements, plan.attention, i) for i in range(len(plan.attention))]
        print("attention outputs:", " ".join("b" if b else p[0] for p, b in zip(plan.attention, rebuilt)),
              "(g=gpu h=host n=not kept" + (", b=kept by the forward that rebuilds the input above)" if any(rebuilt)
                                            else ")"))
    sys.exit(0 if plan.fits else 1)


if __name__ == "__main__":
    try:
        LONGEST = take_longest_options(sys.argv)
    except ConfigError as error:
        print(f"cannot plan: {error}", file=sys.stderr)
        sys.exit(2)
    main()
