"""Memory planner: predicts peak GPU and host bytes of a training step and picks the memory policy.

Everything is counted in bytes from the architecture and the config, before any model exists:

  GPU  = weights + trainable state (params, grads, AdamW moments) + RoPE tables
         + layer inputs and attention outputs kept on the GPU + the largest transient of the step
  host = process baseline + pinned layer inputs and attention outputs

The transient is the larger of a decoder layer's backward (recomputed activations, their gradients,
the next input's prefetch, attention statistics, one MLP tile's intermediates) and the loss (final
hidden states, their gradient and the linear-cross-entropy's chunk budget). Activation counts are in
units of one [tokens, hidden] tensor and were calibrated against measured peaks on the H100
(docs/BENCHMARKS.md, "Training (issue 5)").

`plan_memory` chooses, for the GPU and host it runs on (or the capacities in the config): how many
layers' inputs stay on the GPU (the first k), how many more are recomputed when the host cannot hold
the rest, the MLP tile count, and for how many layers (from the top) the attention output is kept, on
the GPU with the room left, then on the host. `MemoryPlan.failure()` gives the numbers and the settings
that would help; `trainer.build.build_model` raises with it, so the trainer fails before building the
model.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from model.config import LlamaConfig
from conf.schema.memory import check_memory as check_memory_config
from trainer.full_finetune import layout_memory, layouts_to_try, weights_dtype

GIB = 2**30
# Live [tokens, hidden] activations at the peak of a checkpointed layer's backward (incoming gradient,
# input, prefetched next input, recomputed output, norms, q/k/v, attention output and their gradients).
BACKWARD_ACTIVATIONS = 11.0
# The loss phase: last hidden state (kept by the final norm), normed copy, its gradient.
LOSS_ACTIVATIONS = 3.0
# The fused linear-cross-entropy's temporaries (kernels.fused_linear_ce.DEFAULT_MEMORY_BUDGET + slack).
LCE_WORKSPACE = 2 * GIB
# Live [tile_tokens, intermediate] tensors in a tiled MLP's backward (gate, up, act, product, grads).
MLP_TILE_INTERMEDIATES = 6
# CUDA context, cuBLAS workspaces and allocator rounding that max_memory_allocated does not see.
GPU_RESERVE = 2 * GIB
# Fraction of the GPU the plan may fill with predicted allocations (fragmentation, prediction error).
GPU_FILL = 0.94
# Host memory of the training process without pinned buffers (CUDA libraries, Python, data): 1.48-1.56
# GiB peak RSS measured by scripts/bench_train.py on the H100 (a real data pipeline adds its own).
HOST_BASELINE = int(1.5 * GIB)
# Adam: fp32 param + grad + two moments per trainable parameter.
TRAINABLE_BYTES = 16


@dataclass
class Capacity:
    gpu: int
    host: int
    pinnable: int
    # Where "gpu" memory is: on a CPU run the compute device is the host itself.
    device_type: str = "cuda"

    @classmethod
    def detect(cls, device: torch.device, memory_cfg) -> "Capacity":
        host = (memory_cfg.host_memory_gib * GIB if memory_cfg.host_memory_gib is not None
                else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        if memory_cfg.gpu_memory_gib is not None:
            gpu = memory_cfg.gpu_memory_gib * GIB
        elif device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("no CUDA GPU is visible: give memory.gpu_memory_gib to plan for one")
            gpu = torch.cuda.get_device_properties(device).total_memory
        else:
            gpu = host    # the "device" is the host itself
        return cls(int(gpu), int(host), int(host * memory_cfg.pinnable_fraction), device.type)


def pinned_size(nbytes: int) -> int:
    """PyTorch's pinned (caching host) allocator rounds each buffer up to a power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


def parameter_counts(arch: LlamaConfig, train_cfg) -> tuple[int, int]:
    """(all parameters, trainable parameters) of the model as the trainer builds it."""
    d, heads_dim, kv_dim = arch.hidden_size, arch.num_attention_heads * arch.head_dim, \
        arch.num_key_value_heads * arch.head_dim
    shapes = {"q_proj": (d, heads_dim), "k_proj": (d, kv_dim), "v_proj": (d, kv_dim), "o_proj": (heads_dim, d),
              "gate_proj": (d, arch.intermediate_size), "up_proj": (d, arch.intermediate_size),
              "down_proj": (arch.intermediate_size, d)}
    per_layer = sum(i * o for i, o in shapes.values()) + 2 * d
    embeddings = arch.vocab_size * d * (1 if arch.tie_word_embeddings else 2)
    total = arch.num_hidden_layers * per_layer + embeddings + d
    if train_cfg.mode != "lora":
        return total, total
    lora = arch.num_hidden_layers * sum(train_cfg.lora_r * (i + o) for name, (i, o) in shapes.items()
                                        if name in train_cfg.lora_target_modules)
    return total + lora, lora


@dataclass
class MemoryPlan:
    placements: list[str] | None        # per layer: gpu | host | recompute; None: no checkpointing
    mlp_tiles: int
    attention: list[str] | None         # per layer, where its attention output is kept: gpu | host | none
    gpu: dict[str, int]                  # predicted peak GPU bytes, itemized
    host: dict[str, int]                 # predicted peak host bytes, itemized
    capacity: Capacity
    advice: list[str] = field(default_factory=list)
    # train=full: where weights, gradients and AdamW state live (trainer.full_finetune.LAYOUTS).
    full_state: str | None = None

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
    def gpu_limit(self) -> int:
        return int(self.capacity.gpu * GPU_FILL) - GPU_RESERVE

    @property
    def fits(self) -> bool:
        return (self.gpu_peak <= self.gpu_limit and self.host_peak <= self.capacity.host
                and self.pinned <= self.capacity.pinnable)

    @property
    def device_label(self) -> str:
        """What the "gpu" figures describe: the GPU, or on a CPU run the host acting as the device."""
        return "GPU" if self.capacity.device_type == "cuda" else f"{self.capacity.device_type} device"

    def count(self, placement: str) -> int:
        return 0 if self.placements is None else self.placements.count(placement)

    def kept_attention(self, placement: str) -> int:
        return 0 if self.attention is None else self.attention.count(placement)

    def describe(self) -> str:
        lines = [f"memory plan: checkpointing {'off' if self.placements is None else 'on'}, layer inputs "
                 f"gpu={self.count('gpu')} host={self.count('host')} recomputed={self.count('recompute')}, "
                 f"attention outputs kept gpu={self.kept_attention('gpu')} host={self.kept_attention('host')}, "
                 f"mlp_tiles={self.mlp_tiles}" + (f", full_state={self.full_state}" if self.full_state else "")]
        for title, items, total, limit in ((self.device_label, self.gpu, self.gpu_peak, self.gpu_limit),
                                           ("host", self.host, self.host_peak, self.capacity.host)):
            lines.append(f"  {title} peak {total / GIB:7.2f} GiB of {limit / GIB:.2f} GiB usable")
            lines += [f"    {name:<28s}{size / GIB:8.2f} GiB" for name, size in items.items()]
        lines.append(f"  pinned {self.pinned / GIB:.2f} GiB of {self.capacity.pinnable / GIB:.2f} GiB pinnable")
        return "\n".join(lines)

    def failure(self) -> str:
        """Why the plan does not fit: needed vs available on GPU and host, and what would help."""
        return ("the configuration does not fit this machine:\n" + self.describe()
                + "\nsettings that would help:\n" + "\n".join(f"  - {a}" for a in self.advice))


@dataclass
class Shape:
    """Sizes the byte model needs."""
    arch: LlamaConfig
    tokens: int
    act_bytes: int          # bytes per activation element (bf16 under autocast with a bf16 base)

    @property
    def activation(self) -> int:     # one [tokens, hidden] tensor
        return self.tokens * self.arch.hidden_size * self.act_bytes

    @property
    def attention_output(self) -> tuple[int, int]:     # one layer's attention output and fp32 lse
        heads = self.arch.num_attention_heads
        return self.tokens * heads * self.arch.head_dim * self.act_bytes, self.tokens * heads * 4

    @property
    def attention_bytes(self) -> int:                 # one layer's kept attention, on the device
        return sum(self.attention_output)

    @property
    def attention_pinned_bytes(self) -> int:          # the same in the pool (two power-of-two buffers)
        return sum(map(pinned_size, self.attention_output))


def transient_bytes(shape: Shape, tile_tokens: int, checkpointing: bool) -> dict[str, int]:
    arch, a = shape.arch, shape.activation
    if not checkpointing:   # plain autograd keeps every layer's activations
        per_layer = (BACKWARD_ACTIVATIONS - 3 + 3 * arch.intermediate_size / arch.hidden_size) * a
        return {"all layers' activations": int(arch.num_hidden_layers * per_layer)}
    attention_stats = 2 * shape.tokens * arch.num_attention_heads * 4                 # lse + delta, fp32
    mlp_tile = MLP_TILE_INTERMEDIATES * tile_tokens * arch.intermediate_size * shape.act_bytes
    backward = int(BACKWARD_ACTIVATIONS * a) + attention_stats + mlp_tile
    loss = int(LOSS_ACTIVATIONS * a) + LCE_WORKSPACE + shape.tokens * 8
    if backward >= loss:
        return {"layer backward activations": int(BACKWARD_ACTIVATIONS * a),
                "attention statistics": attention_stats, "MLP tile": mlp_tile}
    return {"loss activations": int(LOSS_ACTIVATIONS * a), "cross-entropy workspace": LCE_WORKSPACE}


def _mlp_tiles(tokens: int, memory_cfg) -> int:
    if memory_cfg.mlp_tiles is not None:
        return max(1, memory_cfg.mlp_tiles)
    return max(1, math.ceil(tokens / memory_cfg.mlp_tile_tokens))


def _recomputable(layers: int, on_gpu: int) -> range:
    """Layers whose input may be recomputed, from the top: every other one above the GPU-kept ones (each
    needs the layer below kept), never layer 0."""
    return range(layers - 1, on_gpu, -2)


def _placements(layers: int, on_gpu: int, recomputed: int) -> list[str]:
    """First `on_gpu` layers on the GPU; `recomputed` layers from the top, every other one; the rest on
    the host."""
    placements = ["gpu"] * on_gpu + ["host"] * (layers - on_gpu)
    for index in _recomputable(layers, on_gpu)[:recomputed]:
        placements[index] = "recompute"
    return placements


def max_recomputed(layers: int, on_gpu: int) -> int:
    return len(_recomputable(layers, on_gpu))


def _attention_placements(layers: int, on_gpu: int, on_host: int) -> list[str]:
    """Kept attention outputs from the top layer down (the backward's first): `on_gpu` on the GPU, the
    next `on_host` on the host, none below."""
    kept = ["gpu"] * on_gpu + ["host"] * on_host
    return ["none"] * (layers - len(kept)) + kept[::-1]


@dataclass
class KeptLayers:
    """Where each layer's input and attention output are kept, and what that costs."""
    placements: list[str]
    attention: list[str]
    gpu: dict[str, int]
    host: dict[str, int]


def _keep_layers(shape: Shape, memory_cfg, device: torch.device, room: int, host_room: int) -> KeptLayers:
    """Layer inputs first (the first k on the GPU, the rest on the host, recomputed when the host is full),
    then attention outputs in what room is left. When the inputs do not all fit the GPU, keeping attention
    outputs on the host needs a GPU slot for prefetching them: reserving it may move one input to the host,
    which is taken if it keeps more attention outputs without recomputing more inputs."""
    offload = memory_cfg.offload and device.type == "cuda"
    candidates = [_keep_inputs_then_attention(shape, memory_cfg, offload, room, host_room, reserve)
                  for reserve in ((0, shape.attention_bytes) if offload else (0,))]

    def rank(kept: KeptLayers) -> tuple:
        # One that fits first (an explicit kept_attention_layers count fits only with the reserve), then fewest
        # recomputed inputs, then most kept attention outputs; min() keeps the first (no reserve) on ties.
        overflows = sum(kept.gpu.values()) > room or sum(kept.host.values()) > host_room
        return overflows, kept.placements.count("recompute"), kept.attention.count("none")

    return min(candidates, key=rank)


def _keep_inputs_then_attention(shape: Shape, memory_cfg, offload: bool, room: int, host_room: int,
                                reserve: int) -> KeptLayers:
    layers, a = shape.arch.num_hidden_layers, shape.activation
    # Without CUDA there is nowhere to offload to: the "GPU" is the host.
    on_gpu = layers if not offload else (
        memory_cfg.gpu_layers if memory_cfg.gpu_layers is not None else min(layers, max(0, (room - reserve) // a)))
    on_gpu = min(layers, on_gpu)
    needed = max(0, layers - on_gpu - host_room // pinned_size(a)) if on_gpu < layers else 0
    recomputed = (memory_cfg.recomputed_inputs if memory_cfg.recomputed_inputs is not None
                  else min(needed, max_recomputed(layers, on_gpu)))
    placements = _placements(layers, on_gpu, min(recomputed, max_recomputed(layers, on_gpu)))
    gpu = {"layer inputs on GPU": placements.count("gpu") * a}
    host = {"pinned layer inputs": placements.count("host") * pinned_size(a)} if placements.count("host") else {}
    attention_gpu, attention_host = _kept_attention(shape, memory_cfg, room - gpu["layer inputs on GPU"],
                                                    host_room - host.get("pinned layer inputs", 0), offload)
    gpu["attention outputs on GPU"] = attention_gpu * shape.attention_bytes
    if attention_host:
        gpu["attention output prefetch"] = shape.attention_bytes
        host["pinned attention outputs"] = attention_host * shape.attention_pinned_bytes
    return KeptLayers(placements, _attention_placements(layers, attention_gpu, attention_host), gpu, host)


def _kept_attention(shape: Shape, memory_cfg, gpu_room: int, host_room: int, offload: bool) -> tuple[int, int]:
    """(on GPU, on host) counts of layers whose attention output is kept: all wanted layers that fit the
    GPU room, the rest in the host room (one GPU slot then goes to prefetching them)."""
    layers = shape.arch.num_hidden_layers
    wanted = layers if memory_cfg.kept_attention_layers is None else min(layers, memory_cfg.kept_attention_layers)
    per_layer = shape.attention_bytes
    fit_on_gpu = min(wanted, max(0, gpu_room // per_layer))
    if fit_on_gpu == wanted:
        return fit_on_gpu, 0
    if not offload:      # nowhere else to keep them: an explicit count stays whole, so the plan fails with advice
        return (fit_on_gpu if memory_cfg.kept_attention_layers is None else wanted), 0
    if gpu_room < per_layer and memory_cfg.kept_attention_layers is None:
        return fit_on_gpu, 0               # no GPU slot to prefetch host-kept outputs into
    on_gpu = min(wanted, max(0, gpu_room - per_layer) // per_layer)     # one slot left for the prefetch
    on_host = wanted - on_gpu if memory_cfg.kept_attention_layers is not None else \
        min(wanted - on_gpu, max(0, host_room) // shape.attention_pinned_bytes)
    return (on_gpu, on_host) if on_host else (fit_on_gpu, 0)


def plan_memory(arch: LlamaConfig, train_cfg, memory_cfg, seq_len: int, batch_size: int,
                device: torch.device, capacity: Capacity | None = None, with_advice: bool = True) -> MemoryPlan:
    """The policy for this config on this machine (or `capacity`), with its predicted peaks. Full
    fine-tuning takes the first state layout of train.full_state that fits (trainer.full_finetune)."""
    check_memory_config(memory_cfg)
    capacity = capacity or Capacity.detect(device, memory_cfg)
    layouts = layouts_to_try(getattr(train_cfg, "full_state", "auto")) if train_cfg.mode == "full" else (None,)
    for layout in layouts:
        plan = _plan_layout(arch, train_cfg, memory_cfg, seq_len * batch_size, device, capacity, layout)
        if plan.fits:
            break
    if with_advice and not plan.fits:
        plan.advice = advice(plan, arch, train_cfg, memory_cfg, seq_len, batch_size, device)
    return plan


def _plan_layout(arch: LlamaConfig, train_cfg, memory_cfg, tokens: int, device: torch.device, capacity: Capacity,
                 full_state: str | None) -> MemoryPlan:
    lora_on_gpu = train_cfg.mode == "lora" and device.type == "cuda"
    bf16_weights = lora_on_gpu or (full_state is not None and weights_dtype(full_state) == torch.bfloat16)
    shape = Shape(arch, tokens, 2 if bf16_weights else 4)
    total, trainable = parameter_counts(arch, train_cfg)
    frozen = total - trainable
    trainable_gpu, trainable_host = (layout_memory(full_state, trainable) if full_state else
                                     ({"trainable params+grads+adam": trainable * TRAINABLE_BYTES}, {}))
    trainable_host = {name: pinned_size(size) for name, size in trainable_host.items()}
    static = {"weights": frozen * shape.act_bytes if lora_on_gpu else frozen * 4, **trainable_gpu,
              "rope tables": 2 * shape.tokens * arch.head_dim * shape.act_bytes}
    tiles = _mlp_tiles(shape.tokens, memory_cfg)
    transient = transient_bytes(shape, -(-shape.tokens // tiles), memory_cfg.checkpoint)
    layers, a = arch.num_hidden_layers, shape.activation
    gpu_limit = int(capacity.gpu * GPU_FILL) - GPU_RESERVE
    gpu = dict(static)
    host = {"process baseline": HOST_BASELINE, **trainable_host}
    placements = attention = None
    if memory_cfg.checkpoint:
        room = gpu_limit - sum(static.values()) - sum(transient.values())
        host_room = min(capacity.pinnable, capacity.host - HOST_BASELINE) - sum(trainable_host.values())
        kept = _keep_layers(shape, memory_cfg, device, room, host_room)
        placements, attention = kept.placements, kept.attention
        gpu.update(kept.gpu)
        host.update(kept.host)
    gpu.update(transient)
    return MemoryPlan(placements, tiles, attention, gpu, host, capacity, full_state=full_state)


def advice(plan: MemoryPlan, arch, train_cfg, memory_cfg, seq_len, batch_size, device) -> list[str]:
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
    if memory_cfg.kept_attention_layers:
        tips.append("memory.kept_attention_layers=null (keep only the attention outputs that fit)")
    if plan.mlp_tiles * 4096 < seq_len * batch_size:
        tips.append("memory.mlp_tile_tokens=4096 (smaller MLP tiles)" if memory_cfg.mlp_tiles is None else
                    "memory.mlp_tiles=null memory.mlp_tile_tokens=4096 (smaller MLP tiles; mlp_tiles overrides)")
    fitting = _longest_fitting(arch, train_cfg, memory_cfg, seq_len, batch_size, device, plan.capacity)
    if fitting:
        tips.append(f"seq_len={fitting} (the longest that fits with these settings)" if batch_size == 1 else
                    f"batch_size * seq_len <= {fitting * batch_size} tokens")
    if plan.gpu_peak > plan.gpu_limit:
        tips.append(f"a GPU with at least {(plan.gpu_peak + GPU_RESERVE) / GPU_FILL / GIB:.0f} GiB")
    if plan.host_peak > plan.capacity.host or plan.pinned > plan.capacity.pinnable:
        tips.append(f"a host with at least {max(plan.host_peak, plan.pinned / memory_cfg.pinnable_fraction) / GIB:.0f}"
                    f" GiB of memory")
    return tips


def _longest_fitting(arch, train_cfg, memory_cfg, seq_len, batch_size, device, capacity) -> int | None:
    step = 1024
    low, high = 0, seq_len // step
    while low < high:       # largest multiple of `step` below seq_len that fits
        mid = (low + high + 1) // 2
        if plan_memory(arch, train_cfg, memory_cfg, mid * step, batch_size, device, capacity, False).fits:
            low = mid
        else:
            high = mid - 1
    return low * step or None
