"""The `memory` config group: how activations are kept between forward and backward."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from conf.errors import ConfigError

# memory.gpu: GPUs to plan for by name, with the total memory torch reports for each (GiB; nvidia-smi's
# figure is ~0.5 GiB higher: 81,559 MiB on the H100 80GB, 81,920 on the A100 80GB, 143,771 on the H200).
# What each runs: conf.capability.
GPU_PRESETS = {"a100_80gb": 79.2, "h100_80gb": 79.2, "h200": 139.8}
# scripts/plan.py on a machine without a GPU plans for this GPU and host size unless told otherwise: the
# H100 80GB and the 125 GiB MemTotal of its 128 GiB host, the machine docs/PERFORMANCE.md measures.
PLANNING_GPU, PLANNING_HOST_GIB = "h100_80gb", 125.0


@dataclass
class MemoryConfig:
    # Per-layer activation checkpointing (offload.policy): only each decoder layer's input is kept, the
    # layer is recomputed in the backward. False runs plain autograd (every activation kept on the GPU).
    checkpoint: bool = True
    # Copy the kept layer inputs to pinned host memory on a side CUDA stream. False keeps them on the GPU.
    offload: bool = True
    # Layers (the first k) whose inputs stay on the GPU. None: as many as the planner finds room for. Layer 0's
    # input, the token embedding's output, is looked up again in its backward instead (without FSDP2 or a LoRA
    # adapter on the embedding), so of the first k, k - 1 are kept; and a top layer that is full at no cost
    # (full_layers) is not among the checkpointed ones these counts place.
    gpu_layers: Optional[int] = None
    # Layers whose inputs are not kept at all but recomputed in the backward from the previous layer's
    # input (one extra layer forward each). Needed when host memory cannot hold every input (524k tokens
    # on a 128 GiB host). None: as few as the planner needs.
    recomputed_inputs: Optional[int] = None
    # Layers whose attention output and log-sum-exp are kept from the forward (on the GPU where room is
    # left, else in pinned host memory), so the backward's recomputation skips the attention forward (~15%
    # of a 131k-token step). One more [tokens, hidden] tensor per layer. None: as many as fit; 0: none.
    kept_attention_layers: Optional[int] = None
    # Layers not checkpointed at all ("full": autograd keeps their activations, ~6.5 [tokens, hidden] tensors
    # each, so their backward recomputes nothing but MLP tiles), from the GPU room left: the top layer first
    # where its activations cost nothing (on one CUDA process, where a layer's backward needs more than the
    # loss by a full layer's bytes: Llama-3-8B from about 32k), then from layer 0 up. None: as many as fit (on
    # CUDA with the Triton attention, whose saved tensors the planner counts); 0: none.
    full_layers: Optional[int] = None
    # The MLP runs in sequence tiles of this many tokens (recomputed per tile in the backward), so its
    # 14336-wide intermediates stay bounded as the sequence grows. `mlp_tiles` overrides the count.
    mlp_tile_tokens: int = 16384
    mlp_tiles: Optional[int] = None
    # Capacities the planner fits into; None reads the machine (GPU total memory, host MemTotal). `gpu`
    # names a GPU instead of its size: a100_80gb | h100_80gb | h200 (GPU_PRESETS).
    gpu: Optional[str] = None
    gpu_memory_gib: Optional[float] = None
    host_memory_gib: Optional[float] = None
    # Share of host memory that may be page-locked (what 0.75 pins on the benchmark host at 524k tokens:
    # docs/PERFORMANCE.md, "Memory plans against measured peaks").
    pinnable_fraction: float = 0.75
    # Refuse to build the model when the plan does not fit (the error gives the numbers and the fix).
    check: bool = True


def check_memory(memory_cfg) -> None:
    """Raise ConfigError naming the `memory.*` setting that cannot be planned (before any byte is counted)."""
    at_least = {"mlp_tile_tokens": 1, "mlp_tiles": 1, "gpu_layers": 0, "recomputed_inputs": 0,
                "kept_attention_layers": 0, "full_layers": 0}
    for name, low in at_least.items():
        value = getattr(memory_cfg, name)
        if value is not None and value < low:
            unset = "" if name == "mlp_tile_tokens" else " (or null to let the planner choose)"
            raise ConfigError(f"memory.{name}={value} must be at least {low}{unset}")
    if not 0.0 <= memory_cfg.pinnable_fraction <= 1.0:
        raise ConfigError(f"memory.pinnable_fraction={memory_cfg.pinnable_fraction} must be within [0, 1]")
    for name in ("gpu_memory_gib", "host_memory_gib"):
        value = getattr(memory_cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"memory.{name}={value} must be positive (or null to read this machine's)")
    if memory_cfg.gpu is not None:
        if memory_cfg.gpu not in GPU_PRESETS:
            raise ConfigError(f"memory.gpu={memory_cfg.gpu!r} is not one of {tuple(GPU_PRESETS)} "
                              f"(or give memory.gpu_memory_gib=<GiB>)")
        if memory_cfg.gpu_memory_gib not in (None, GPU_PRESETS[memory_cfg.gpu]):    # once resolved, equal
            raise ConfigError(f"memory.gpu={memory_cfg.gpu} and memory.gpu_memory_gib={memory_cfg.gpu_memory_gib}: "
                              f"give one")


def resolve_gpu_preset(memory_cfg) -> None:
    """Fill memory.gpu_memory_gib from the GPU named by memory.gpu (checked by check_memory)."""
    if memory_cfg.gpu is not None:
        memory_cfg.gpu_memory_gib = GPU_PRESETS[memory_cfg.gpu]
