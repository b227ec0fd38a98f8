"""Print the memory plan of a config: `.venv/bin/python scripts/plan.py model=llama3_8b train=lora seq_len=524288`.

Plans for the GPU and host of this machine. Elsewhere name the target GPU, `memory.gpu=a100_80gb|h100_80gb|
h200`, or give its size, `memory.gpu_memory_gib=79.2`, and the host's, `memory.host_memory_gib=125`; on a
machine without a GPU the plan is for an H100 80GB on a 125 GiB host unless told otherwise (it says so).
Several GPUs: `parallel.sequence=8` plans one of 8 sequence-parallel ranks; WORLD_SIZE=N (as torchrun sets
it) plans one of N ranks (data parallel beyond the sequence degree; `parallel.shard=true` shards full
fine-tuning over all N). The ranks share one host unless LOCAL_WORLD_SIZE (the ranks per machine) says otherwise.
Exits 1 when the plan does not fit, 2 when it cannot be made (the message names the setting to give).
"""
import os
import sys

import hydra
import torch

from conf.schema import JobConfig, register_configs
from conf.schema.memory import PLANNING_GPU, PLANNING_HOST_GIB, check_memory, resolve_gpu_preset
from conf.schema.train import check_fp8, check_train
from conf.schema.parallel import world_size
from conf.validate import check_finite_numbers, check_known_keys
from offload.placement import rebuilding_keeps
from offload.store import Placement
from trainer.build import plan_for

register_configs()


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
    main()
