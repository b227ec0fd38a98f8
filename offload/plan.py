"""Memory planner: predicts peak GPU and host bytes of a training step and picks the memory policy.

`plan_memory` chooses, for the GPU and host it runs on (or the capacities in the config): for full
fine-tuning the optimizer-state layout (offload.state_layouts), how many layers' inputs stay on the GPU
(the first k), how many more are recomputed when the host cannot hold the rest, the MLP tile count, and
for how many layers (from the top) the attention output is kept, on the GPU with the room left, then on
the host (offload.placement). Bytes are counted by offload.byte_model. `MemoryPlan.failure()` gives the
numbers and the settings that would help; `trainer.build.build_model` raises with it, so the trainer
fails before building the model. The `memory.*` settings are checked by the config validation first.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from conf.schema.train import fp8_base
from kernels.attention import AttentionRoute
from model.config import DecoderConfig
from offload.byte_model import (GPU_FILL, GPU_RESERVE, HOST_BASELINE, TRAINABLE_BYTES, Capacity, Shape,
                                eval_forward_bytes, fp8_transient_bytes, frozen_weight_bytes,
                                full_layer_bytes, layer_parameters, parameter_counts, pinned_size,
                                sequence_exchange_bytes, top_layer_full_costs_nothing, transient_bytes)
from offload.placement import FULLEST_MOMENT, MADE_LAST, PREFETCH_SLOT, GpuRoom, keep_layers, with_full_layers
from offload.state_layouts import DISTRIBUTED_LAYOUTS, layout_memory, layouts_to_try, weights_dtype
from offload.store import AttentionPlacement, Placement
from offload.units import GIB


@dataclass(frozen=True)
class Ranks:
    """The processes a job runs in, as far as one rank's memory is concerned."""
    sequence: int = 1      # the sequence-parallel degree: each rank holds 1/sequence of each sequence
    per_host: int = 1      # ranks on one machine, which share its host memory
    world: int = 1         # all ranks of the job
    shard: bool = False    # FSDP2 (parallel.shard): the full fine-tuning state split over the world


@dataclass
class MemoryPlan:
    placements: list[Placement] | None  # per layer: gpu | host | recompute | full | embedding; None: no checkpointing
    mlp_tiles: int
    attention: list[AttentionPlacement] | None  # per layer, where its attention output is kept: gpu | host | none
    gpu: dict[str, int]                  # predicted peak GPU bytes, itemized
    host: dict[str, int]                 # predicted peak host bytes, itemized
    capacity: Capacity
    # The sizes the bytes were counted from; the memory policy pins its host buffers at them.
    shape: Shape
    advice: list[str] = field(default_factory=list)
    # train=full: where weights, gradients and AdamW state live (offload.state_layouts).
    full_state: str | None = None
    # The attention route the bytes were counted for (kernels.attention.candidates), which the build installs.
    attention_route: AttentionRoute = AttentionRoute()
    # The top layer is full at no cost: its bytes are not among the full layers' (offload.placement).
    top_layer_free: bool = False
    # Predicted GPU peak of an evaluation (trainer.evaluate): what stays between steps (weights, trainable
    # state, RoPE tables) and a forward without grad, with the same parallelism's buffers; below gpu_peak.
    eval_peak: int = 0

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the model's weights are built in, the one the bytes were counted for: bf16 for a frozen
        LoRA base on the GPU and the bf16 state layouts, else fp32 (computing under bf16 autocast)."""
        return torch.bfloat16 if self.shape.act_bytes == 2 else torch.float32

    @property
    def attention_kernel(self) -> str:
        return self.attention_route.plan_kernel

    @property
    def gpu_peak(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_peak(self) -> int:
        return sum(self.host.values())

    @property
    def pinned(self) -> int:
        return sum(size for name, size in self.host.items() if name.startswith("pinned"))

    @property
    def fits(self) -> bool:
        return (self.gpu_peak <= self.capacity.gpu_limit and self.host_peak <= self.capacity.host
                and self.pinned <= self.capacity.pinnable)

    @property
    def device_label(self) -> str:
        """What the "gpu" figures describe: the GPU, or on a CPU run the host acting as the device."""
        return "GPU" if self.capacity.device_type == "cuda" else f"{self.capacity.device_type} device"

    def count(self, placement: Placement) -> int:
        return 0 if self.placements is None else self.placements.count(placement)

    def kept_attention(self, placement: AttentionPlacement) -> int:
        return 0 if self.attention is None else self.attention.count(placement)

    def describe(self) -> str:
        full = self.count(Placement.FULL)
        lines = [f"memory plan: checkpointing {'off' if self.placements is None else 'on'}, layer inputs "
                 f"gpu={self.count(Placement.GPU)} host={self.count(Placement.HOST)} "
                 f"recomputed={self.count(Placement.RECOMPUTE)}, " + (f"full layers={full}, " if full else "")
                 + f"attention outputs kept gpu={self.kept_attention(AttentionPlacement.GPU)} "
                 f"host={self.kept_attention(AttentionPlacement.HOST)}, mlp_tiles={self.mlp_tiles}"
                 + (f", full_state={self.full_state}" if self.full_state else "")
                 + f", attention kernel {self.attention_kernel}"
                 + (", layer 0's input looked up again from the embedding" if self.count(Placement.EMBEDDING) else "")]
        for title, items, total, limit in ((self.device_label, self.gpu, self.gpu_peak, self.capacity.gpu_limit),
                                           ("host", self.host, self.host_peak, self.capacity.host)):
            lines.append(f"  {title} peak {total / GIB:7.2f} GiB of {limit / GIB:.2f} GiB usable")
            lines += [f"    {name:<28s}{size / GIB:8.2f} GiB" for name, size in items.items()]
            if title == self.device_label and self.top_layer_free:
                lines.append("    (the top layer's activations, full, fit in the transient: they live beside the loss "
                             "and in its own backward, the first)")
            if title == self.device_label and MADE_LAST in items:
                lines.append("    (its fullest moment, the backward's end: every gradient made)")
            elif title == self.device_label and (FULLEST_MOMENT in items or PREFETCH_SLOT in items):
                lines.append("    (its fullest moment, in the backward: what the layers not yet back-propagated keep"
                             + (", the gradients made so far" if FULLEST_MOMENT in items else "")
                             + (", the slot the next kept attention output is copied back into"
                                if PREFETCH_SLOT in items else "") + ")")
        lines.append(f"  pinned {self.pinned / GIB:.2f} GiB of {self.capacity.pinnable / GIB:.2f} GiB pinnable")
        return "\n".join(lines)

    def failure(self) -> str:
        """Why the plan does not fit: needed vs available on GPU and host, and what would help."""
        return ("the configuration does not fit this machine:\n" + self.describe()
                + "\nsettings that would help:\n" + "\n".join(f"  - {a}" for a in self.advice))


def mlp_tiles(tokens: int, memory_cfg) -> int:
    """MLP row tiles for `tokens` tokens: memory.mlp_tiles, else one per memory.mlp_tile_tokens."""
    if memory_cfg.mlp_tiles is not None:
        return max(1, memory_cfg.mlp_tiles)
    return max(1, math.ceil(tokens / memory_cfg.mlp_tile_tokens))


def plan_memory(arch: DecoderConfig, train_cfg, memory_cfg, seq_len: int, batch_size: int,
                device: torch.device, capacity: Capacity | None = None, with_advice: bool = True,
                attention_routes: tuple[AttentionRoute, ...] = (AttentionRoute(),), ranks: Ranks = Ranks(),
                micro_batches: int = 1) -> MemoryPlan:
    """The policy for this config on this machine (or `capacity`), with its predicted peaks. The first
    attention route of `attention_routes` (fastest first: kernels.attention.candidates) that fits, and for full
    fine-tuning the first state layout of train.full_state that fits with it (offload.state_layouts).
    Several processes (`ranks`): the plan of one rank, which holds 1/ranks.sequence of each sequence and
    shares the host with ranks.per_host - 1 others. `micro_batches` (optim.grad_accum_steps) > 1 keeps the
    gradients of one micro-batch through the next's forward and backward."""
    capacity = capacity or Capacity.detect(device, memory_cfg).shared_by(ranks.per_host)
    layouts = layouts_to_try(getattr(train_cfg, "full_state", "auto")) if train_cfg.mode == "full" else (None,)
    if ranks.world > 1 and train_cfg.mode == "full" and not ranks.shard:
        layouts = DISTRIBUTED_LAYOUTS     # the streamed bf16 states run over several processes only sharded
    for attention_route, layout in ((route, layout) for route in attention_routes for layout in layouts):
        plan = _plan_layout(arch, train_cfg, memory_cfg, seq_len * batch_size // ranks.sequence, device, capacity,
                            layout, attention_route, ranks, micro_batches)
        if plan.fits:
            break
    if with_advice and not plan.fits:
        plan.advice = advice(plan, arch, train_cfg, memory_cfg, seq_len, batch_size, device, ranks, micro_batches)
    return plan


def _plan_layout(arch: DecoderConfig, train_cfg, memory_cfg, tokens: int, device: torch.device, capacity: Capacity,
                 full_state: str | None, attention_route: AttentionRoute, ranks: Ranks,
                 micro_batches: int) -> MemoryPlan:
    attention_kernel = attention_route.plan_kernel
    lora_on_gpu = train_cfg.mode == "lora" and device.type == "cuda"
    bf16_weights = lora_on_gpu or (full_state is not None and weights_dtype(full_state) == torch.bfloat16)
    shape = Shape(arch, tokens, 2 if bf16_weights else 4)
    sequence_parallel, sharded = ranks.sequence, ranks.shard and ranks.world > 1
    total, trainable = parameter_counts(arch, train_cfg)
    frozen = total - trainable
    # FSDP2 (trainer.sharding) leaves each rank 1/world of every weight, trained or frozen.
    own, frozen = (-(-trainable // ranks.world), -(-frozen // ranks.world)) if sharded else (trainable, frozen)
    trainable_gpu, trainable_host = (layout_memory(full_state, own) if full_state else
                                     ({"trainable params+grads+adam": own * TRAINABLE_BYTES}, {}))
    trainable_host = {name: pinned_size(size) for name, size in trainable_host.items()}
    layer_gradient = embedding_gradient = 0
    if full_state == "bf16" and not sharded and micro_batches == 1 and memory_cfg.checkpoint:
        # The decoder layers' gradients are made in the backward as their kept activations are freed, and an
        # untied input embedding's after all of them (placement.GpuRoom, the checkpointed layers' search);
        # the head's and the final norm's, made by the loss, stay counted whole, as all are without it.
        layer_gradient = 2 * layer_parameters(arch)
        embedding_gradient = 0 if arch.tie_word_embeddings else 2 * arch.vocab_size * arch.hidden_size
        trainable_gpu["bf16 gradients"] -= arch.num_hidden_layers * layer_gradient + embedding_gradient
        trainable_gpu["bf16 non-layer gradients"] = trainable_gpu.pop("bf16 gradients")
    static = {"weights": frozen_weight_bytes(arch, train_cfg, frozen, shape.act_bytes if lora_on_gpu else 4),
              **trainable_gpu,
              "rope tables": 2 * shape.tokens * arch.head_dim * shape.act_bytes}
    tiles = mlp_tiles(shape.tokens, memory_cfg)
    transient = transient_bytes(shape, train_cfg, tiles, memory_cfg.checkpoint, capacity.device_type,
                                attention_kernel, sequence_parallel, one_process=ranks.world == 1)
    if fp8_base(train_cfg):
        transient["FP8 copies"] = fp8_transient_bytes(arch, shape.tokens, -(-shape.tokens // tiles))
    if sequence_parallel > 1:
        transient["sequence-parallel exchange"] = sequence_exchange_bytes(shape, sequence_parallel)
    if sharded and full_state:
        transient["FSDP gathered weights+grads"] = gathered_bytes(arch, weights_dtype(full_state).itemsize)
    elif sharded:       # LoRA: the frozen base has no gradients (the adapters' are small)
        transient["FSDP gathered weights"] = gathered_bytes(arch, shape.act_bytes if lora_on_gpu else 4, False)
    gpu = dict(static)
    host = {"process baseline": HOST_BASELINE, **trainable_host}
    placements = attention = None
    top_full = False
    if memory_cfg.checkpoint:
        full_layer = full_layer_bytes(shape, train_cfg, tiles > 1, capacity.device_type, sequence_parallel)
        wanted_full = _wanted_full_layers(memory_cfg, device)
        top_full = wanted_full != 0 and top_layer_full_costs_nothing(shape, full_layer, tiles, attention_kernel,
                                                                     capacity.device_type, ranks.world == 1)
        room = GpuRoom(capacity.gpu_limit - sum(static.values()) - sum(transient.values()), layer_gradient,
                       int(top_full), embedding_gradient)
        host_room = min(capacity.pinnable, capacity.host - HOST_BASELINE) - sum(trainable_host.values())
        kept = keep_layers(shape, memory_cfg, device, room, host_room, arch.num_hidden_layers - top_full,
                           from_embedding=_embedding_looked_up_again(train_cfg, sharded))
        kept = with_full_layers(kept, shape, full_layer, room, host_room, wanted_full, top_full)
        placements, attention = kept.placements, kept.attention
        gpu.update(kept.gpu)
        host.update(kept.host)
    gpu.update(transient)
    buffers = sum(size for name, size in transient.items() if name.startswith(("sequence-parallel", "FSDP")))
    eval_peak = sum(static.values()) + eval_forward_bytes(shape, -(-shape.tokens // tiles)) + buffers
    return MemoryPlan(placements, tiles, attention, gpu, host, capacity, shape, full_state=full_state,
                      attention_route=attention_route, top_layer_free=top_full, eval_peak=eval_peak)


def _embedding_looked_up_again(train_cfg, sharded: bool) -> bool:
    """Whether layer 0's input, the token embedding's output, is looked up again in its backward rather than
    kept (offload.store.EmbeddingLookup): for a plain embedding, not one with a LoRA adapter (whose forward
    adds the adapter's product), and not under FSDP2 (parallel.shard), whose embedding weight is whole only
    inside its module's own hooks."""
    adapted = train_cfg.mode == "lora" and any(name.rsplit(".", 1)[-1] == "embed_tokens"
                                               for name in train_cfg.lora_target_modules)
    return not (adapted or sharded)


def gathered_bytes(arch: DecoderConfig, weight_bytes: int, gradients: bool = True) -> int:
    """FSDP2 (trainer.sharding) at its widest: the root's embeddings and head, gathered from the forward to
    the backward, and two layers' weights (one in use, the next prefetched), each (`gradients`) with an
    unsharded gradient before its reduce-scatter."""
    d = arch.hidden_size
    embeddings = arch.vocab_size * d * (1 if arch.tie_word_embeddings else 2)
    return (2 if gradients else 1) * (embeddings + 2 * layer_parameters(arch)) * weight_bytes


def _wanted_full_layers(memory_cfg, device: torch.device) -> int | None:
    """memory.full_layers; left to the planner (None) only on CUDA, where the byte model's Triton attention
    runs (trainer.build.memory_settings sets 0 where the reference attention would run)."""
    if memory_cfg.full_layers is not None:
        return memory_cfg.full_layers
    return None if device.type == "cuda" else 0


def advice(plan: MemoryPlan, arch, train_cfg, memory_cfg, seq_len, batch_size, device, ranks: Ranks,
           micro_batches: int) -> list[str]:
    """Settings that would make a failing plan fit."""
    tips = []
    if not memory_cfg.checkpoint:
        tips.append("memory.checkpoint=true (keep only each layer's input)")
    if not memory_cfg.offload:
        tips.append("memory.offload=true (move layer inputs to pinned host memory)")
    if memory_cfg.gpu_layers is not None:
        tips.append("memory.gpu_layers=null (let the planner choose how many inputs stay on the GPU)")
    if memory_cfg.recomputed_inputs is not None:
        tips.append("memory.recomputed_inputs=null (let the planner recompute inputs the host cannot hold)")
    if memory_cfg.full_layers:
        tips.append("memory.full_layers=null (keep every activation only of the layers that fit)")
    if memory_cfg.kept_attention_layers:
        tips.append("memory.kept_attention_layers=null (keep only the attention outputs that fit)")
    if plan.mlp_tiles * 4096 < seq_len * batch_size:
        tips.append("memory.mlp_tile_tokens=4096 (smaller MLP tiles)" if memory_cfg.mlp_tiles is None else
                    "memory.mlp_tiles=null memory.mlp_tile_tokens=4096 (smaller MLP tiles; mlp_tiles overrides)")

    def plan_at(length: int) -> MemoryPlan:
        return plan_memory(arch, train_cfg, memory_cfg, length, batch_size, device, plan.capacity, False,
                           ranks=ranks, micro_batches=micro_batches)
    longest = longest_fitting(plan_at, 1024, below=seq_len)
    if longest:
        fitting = longest[0]
        tips.append(f"seq_len={fitting} (the longest that fits with these settings)" if batch_size == 1 else
                    f"batch_size * seq_len <= {fitting * batch_size} tokens")
    if plan.gpu_peak > plan.capacity.gpu_limit and plan.capacity.device_type == "cuda":
        tips.append(f"a GPU with at least {(plan.gpu_peak + GPU_RESERVE) / GPU_FILL / GIB:.0f} GiB")
    if plan.host_peak > plan.capacity.host or plan.pinned > plan.capacity.pinnable:
        tips.append(f"a host with at least {max(plan.host_peak, plan.pinned / memory_cfg.pinnable_fraction) / GIB:.0f}"
                    f" GiB of memory")
    return tips


def longest_fitting(plan_at: Callable[[int], MemoryPlan], step: int, below: int | None = None,
                    start: int | None = None) -> tuple[int, MemoryPlan] | None:
    """The longest sequence, a multiple of `step`, whose plan (`plan_at(length)`) fits, with that plan: below
    `below`, or without it from `start` (a multiple of `step`, a guess; else `step`) up, in strides that double
    (1, 2, 4... steps) until one does not fit, or down so where `start` does not. Then a bisection, taking that
    a plan fits at every length below one that fits; the answer is a boundary: the plan `step` tokens longer
    was made and does not fit (or that length is not below `below`). None where nothing fits."""
    fitting, low = None, 0
    if below is None:
        high, stride = (start or step) // step, 1       # in steps
        while (plan := plan_at(high * step)).fits:
            fitting, low, high, stride = plan, high, high + stride, 2 * stride
        while fitting is None and high > 1:
            probe = max(1, high - stride)
            if (plan := plan_at(probe * step)).fits:
                fitting, low = plan, probe
            else:
                high, stride = probe, 2 * stride
    else:
        high = -(-below // step)
    while high - low > 1:
        mid = (low + high) // 2
        plan = plan_at(mid * step)
        if plan.fits:
            fitting, low = plan, mid
        else:
            high = mid
    return None if fitting is None else (low * step, fitting)
