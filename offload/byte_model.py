"""The planner's byte model: what a training step holds on the GPU and the host, counted from the
architecture and the config before any model exists.

  GPU  = weights + trainable state (params, grads, AdamW moments) + RoPE tables
         + layer inputs and attention outputs kept on the GPU + the largest transient of the step
  host = process baseline + pinned layer inputs and attention outputs

A "full" layer (not checkpointed: autograd keeps its activations, `full_layer_bytes`) holds everything its
backward reads instead of its input and attention output; without checkpointing every layer is one. The
transient is the larger of a decoder layer's backward (recomputed activations, their gradients, the next
input's prefetch, attention statistics, one MLP tile's intermediates) and the loss (final hidden states,
their gradient and the linear-cross-entropy's chunk budget). Activation counts are in units of one [tokens,
hidden] tensor and were calibrated against measured peaks on the H100 (docs/PERFORMANCE.md, "Memory plans
against measured peaks"). The memory policy pins its host buffers at these sizes (`Shape`), so what the plan
counts is what is allocated.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from conf.schema.train import fp8_base
from conf.schema.parallel import padded_query_heads
from kernels.attention import cudnn_attention
from model.config import DecoderConfig
from model.family import bias_shapes, norm_shapes, projection_shapes, saved_by_qk_norm
from offload.units import GIB

# Live [tokens, hidden] activations at the peak of a checkpointed layer's backward (incoming gradient,
# input, prefetched next input, recomputed output, norms, q/k/v, attention output and their gradients), of
# which q, the attention output and their gradients are [tokens, heads x head_dim] (Shape.query: the same
# size where heads x head_dim is the hidden size, as in the 8B models; wider in some other sizes).
BACKWARD_ACTIVATIONS = 11.0
BACKWARD_QUERY_WIDE = 4
# The loss phase: last hidden state (kept by the final norm), normed copy, its gradient.
LOSS_ACTIVATIONS = 3.0
# An evaluation's forward without grad (trainer.evaluate): live [tokens, hidden] activations at a layer's
# fullest (its input, the normed input, q and its rotation, the attention output and its projection, the
# residual sum; q, its rotation and the attention output query-wide) and one MLP tile's gate, up and product;
# the loss's final hidden state and its norm.
EVAL_FORWARD_ACTIVATIONS = 7.0
EVAL_QUERY_WIDE = 3
EVAL_MLP_TILE_INTERMEDIATES = 3
EVAL_LOSS_ACTIVATIONS = 2.0
# The fused linear-cross-entropy's temporaries (kernels.linear_cross_entropy_triton.DEFAULT_MEMORY_BUDGET + slack).
LCE_WORKSPACE = 2 * GIB
# Live [tile_tokens, intermediate] tensors in a tiled MLP's backward (gate, up, the product, its gradient,
# the gradients of gate and up).
MLP_TILE_INTERMEDIATES = 6
# CUDA context, cuBLAS workspaces and allocator rounding that max_memory_allocated does not see.
GPU_RESERVE = 2 * GIB
# Fraction of the GPU the plan may fill with predicted allocations (fragmentation, prediction error).
GPU_FILL = 0.94
# Host memory of the training process without pinned buffers (CUDA libraries, Python, data): the peak RSS
# scripts/bench_train.py measured on the H100's host (docs/PERFORMANCE.md, "Design choices measured"); a
# real data pipeline adds its own.
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

    def shared_by(self, ranks: int) -> "Capacity":
        """One rank's share where `ranks` processes of a job share this host (its GPU is its own; on a CPU
        run the "GPU" is the host too)."""
        gpu = self.gpu // ranks if self.device_type != "cuda" else self.gpu
        return Capacity(gpu, self.host // ranks, self.pinnable // ranks, self.device_type)

    @property
    def gpu_limit(self) -> int:
        """The GPU bytes a plan may fill with predicted allocations."""
        return int(self.gpu * GPU_FILL) - GPU_RESERVE


def pinned_size(nbytes: int) -> int:
    """PyTorch's pinned (caching host) allocator rounds each buffer up to a power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


def parameter_counts(arch: DecoderConfig, train_cfg) -> tuple[int, int]:
    """(all parameters, trainable parameters) of the model as the trainer builds it."""
    d = arch.hidden_size
    embeddings = arch.vocab_size * d * (1 if arch.tie_word_embeddings else 2)
    total = arch.num_hidden_layers * layer_parameters(arch) + embeddings + d
    if train_cfg.mode != "lora":
        return total, total
    lora = arch.num_hidden_layers * _adapter_parameters(arch, train_cfg, projection_shapes(arch).keys())
    return total + lora, lora


def layer_parameters(arch: DecoderConfig) -> int:
    """One decoder layer's parameters: its projections, their biases and its norms (model.family says which)."""
    return (sum(i * o for i, o in projection_shapes(arch).values()) + sum(bias_shapes(arch).values())
            + sum(norm_shapes(arch).values()))


def _adapter_parameters(arch: DecoderConfig, train_cfg, names: Iterable[str]) -> int:
    """LoRA parameters of one layer's adapters on the projections in `names`."""
    shapes = projection_shapes(arch)
    return sum(train_cfg.lora_r * sum(shapes[name]) for name in names if name in train_cfg.lora_target_modules)


def frozen_weight_bytes(arch: DecoderConfig, train_cfg, frozen: int, weight_bytes: int) -> int:
    """The frozen weights' bytes: `weight_bytes` per weight, or with an FP8 base one byte per decoder
    projection weight and an fp32 scale per projection row."""
    if not fp8_base(train_cfg):
        return frozen * weight_bytes
    shapes = projection_shapes(arch).values()
    projections = arch.num_hidden_layers * sum(i * o for i, o in shapes)
    rows = arch.num_hidden_layers * sum(o for _, o in shapes)
    return (frozen - projections) * weight_bytes + projections + 4 * rows


def fp8_transient_bytes(arch: DecoderConfig, tokens: int, tile_tokens: int) -> int:
    """What FP8 products (train.fp8) add to a layer's backward, one byte an element: the quantized input that
    q, k and v share while they are recomputed, the widest quantized gradient (an attention projection's over
    every token, or an MLP tile's) with fp32 row scales, and the transposed weight its product reads."""
    shapes = projection_shapes(arch)
    attention_width = max(shapes[name][1] for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    gradient = max(tokens * attention_width, tile_tokens * arch.intermediate_size) + 4 * tokens
    return tokens * arch.hidden_size + gradient + max(i * o for i, o in shapes.values())


@dataclass
class Shape:
    """Sizes the byte model needs."""
    arch: DecoderConfig
    tokens: int
    act_bytes: int          # bytes per activation element (bf16 under autocast with a bf16 base)

    @property
    def activation(self) -> int:     # one [tokens, hidden] tensor: a layer's input
        return self.tokens * self.arch.hidden_size * self.act_bytes

    @property
    def query(self) -> int:          # one [tokens, heads x head_dim] tensor: q, or the attention output
        return self.tokens * self.arch.num_attention_heads * self.arch.head_dim * self.act_bytes

    def activations(self, count: float, query_wide: int) -> int:
        """`count` activations of a layer, `query_wide` of them [tokens, heads x head_dim] (Shape.query)."""
        return int((count - query_wide) * self.activation) + query_wide * self.query

    @property
    def attention_output(self) -> tuple[int, int]:     # one layer's attention output and fp32 lse
        heads = self.arch.num_attention_heads
        return self.tokens * heads * self.arch.head_dim * self.act_bytes, self.tokens * heads * 4

    @property
    def output_fits_input_slot(self) -> bool:         # where heads * head_dim <= hidden_size
        """Whether an attention output fits a layer input's pinned buffer (offload.store.rebuilds_attention)."""
        return self.attention_output[0] <= self.activation

    @property
    def attention_bytes(self) -> int:                 # one layer's kept attention, on the device
        return sum(self.attention_output)

    @property
    def attention_pinned_bytes(self) -> int:          # the same in the pool (two power-of-two buffers)
        return sum(map(pinned_size, self.attention_output))


def transient_bytes(shape: Shape, train_cfg, mlp_tiles: int, checkpointing: bool,
                    device_type: str = "cuda", attention_kernel: str = "flash",
                    sequence_parallel: int = 1, one_process: bool = True) -> dict[str, int]:
    """The step's largest transient: a decoder layer's backward or the loss, whichever is larger; without
    checkpointing (plain autograd) every layer is a full one and keeps its activations under it, but for the
    top layer's where they cost nothing beside the loss (`top_layer_full_costs_nothing`)."""
    transient = _backward_or_loss(shape, -(-shape.tokens // mlp_tiles), attention_kernel)
    if checkpointing:
        return transient
    full_layer = full_layer_bytes(shape, train_cfg, mlp_tiles > 1, device_type, sequence_parallel)
    held = shape.arch.num_hidden_layers - top_layer_full_costs_nothing(shape, full_layer, mlp_tiles, attention_kernel,
                                                                       device_type, one_process)
    return {"all layers' activations": held * full_layer, **transient}


def _backward_or_loss(shape: Shape, tile_tokens: int, attention_kernel: str) -> dict[str, int]:
    backward = _layer_backward(shape, tile_tokens, attention_kernel)
    if sum(backward.values()) >= loss_bytes(shape):
        return backward
    return {"loss activations": int(LOSS_ACTIVATIONS * shape.activation), "cross-entropy workspace": LCE_WORKSPACE}


def _layer_backward(shape: Shape, tile_tokens: int, attention_kernel: str) -> dict[str, int]:
    """A checkpointed layer's backward at its peak: its recomputed activations, their gradients, the
    attention's statistics (and cuDNN's workspace) and one MLP tile's intermediates."""
    arch = shape.arch
    attention_stats = 2 * shape.tokens * arch.num_attention_heads * 4                 # lse + delta, fp32
    attention_label = "attention statistics"
    if attention_kernel == "cudnn":        # cuDNN's backward workspace, beside the statistics it keeps
        attention_stats += cudnn_attention.backward_workspace_bytes(
            shape.tokens, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, shape.act_bytes)
        attention_label = "attention stats+workspace"
    mlp_tile = MLP_TILE_INTERMEDIATES * tile_tokens * arch.intermediate_size * shape.act_bytes
    # QK-norm's recomputed inputs (q and k before the norm) and their gradients, beside the calibrated count
    activations = (shape.activations(BACKWARD_ACTIVATIONS, BACKWARD_QUERY_WIDE)
                   + 2 * shape.tokens * saved_by_qk_norm(arch, shape.act_bytes))
    return {"layer backward activations": activations, attention_label: attention_stats, "MLP tile": mlp_tile}


def loss_bytes(shape: Shape) -> int:
    """The loss phase: its activations, the cross-entropy's workspace and the per-token labels and losses."""
    return int(LOSS_ACTIVATIONS * shape.activation) + LCE_WORKSPACE + shape.tokens * 8


def eval_forward_bytes(shape: Shape, tile_tokens: int) -> int:
    """An evaluation's transient, a forward without grad that keeps nothing: a decoder layer's forward (its
    activations, the attention statistics, one MLP tile's intermediates) or the loss's, whichever is larger.
    Each is counted below its training counterpart (the backward's and the loss with its gradient)."""
    arch = shape.arch
    layer = (shape.activations(EVAL_FORWARD_ACTIVATIONS, EVAL_QUERY_WIDE) + shape.tokens * arch.num_attention_heads * 4
             + EVAL_MLP_TILE_INTERMEDIATES * tile_tokens * arch.intermediate_size * shape.act_bytes)
    loss = int(EVAL_LOSS_ACTIVATIONS * shape.activation) + LCE_WORKSPACE + shape.tokens * 8
    return max(layer, loss)


def top_layer_full_costs_nothing(shape: Shape, full_layer: int, mlp_tiles: int, attention_kernel: str,
                                 device_type: str = "cuda", one_process: bool = True) -> bool:
    """Whether the top decoder layer can keep every activation (a "full" layer, `full_layer` bytes) without
    raising the step's peak: on one CUDA process (the bytes of full layers are counted for the GPU's attention;
    sequence parallelism's and FSDP2's own buffers around the top layer were not measured). Its forward is the
    last and its backward the first, so what it keeps lives only through the loss and its own backward:
    beside the loss it must fit in what a checkpointed layer's backward needs more than the loss, and its
    backward holds what a checkpointed one's recomputation would have rebuilt (the same activations) with the
    same gradients. Every other layer's kept bytes are held through every
    layer's backward (offload.placement); these are not, which is why at 524k tokens the top layer can skip its
    recomputation (an attention forward and the rebuild of its input) where no other layer has room to."""
    if device_type != "cuda" or not one_process:
        return False
    backward = sum(_layer_backward(shape, -(-shape.tokens // mlp_tiles), attention_kernel).values())
    return full_layer + loss_bytes(shape) <= backward


def sequence_exchange_bytes(shape: Shape, degree: int) -> int:
    """Sequence parallelism over `degree` ranks (kernels.attention.sequence_parallel): the all-to-alls' copies of q, k
    and v (KV heads repeated up to the degree when fewer, query heads padded to a multiple of it) and of the
    attention output, live together in a layer's backward. `shape.tokens` is this rank's slice."""
    if degree == 1:
        return 0
    arch = shape.arch
    q_heads = padded_query_heads(arch.num_attention_heads, arch.num_key_value_heads, degree)
    heads = q_heads + 2 * max(arch.num_key_value_heads, degree) + q_heads
    return shape.tokens * heads * arch.head_dim * shape.act_bytes


def full_layer_bytes(shape: Shape, train_cfg, mlp_tiled: bool, device_type: str = "cuda",
                     sequence_parallel: int = 1) -> int:
    """Bytes autograd keeps from one "full" layer's forward to its backward, read off the ops (and pinned by
    tests/test_byte_model.py to a measurement with saved-tensor hooks, in fp32 and as the trainer runs LoRA on
    a GPU: bf16 base, fp32 adapters, bf16 autocast): the two norms' inputs (the layer input and the residual
    after attention) and fp32 rstds; the Triton attention's q, k, v after RoPE, output, fp32 log-sum-exp and
    int32 document bounds (RoPE's products keep only the shared cos/sin tables); with QK-norm, its inputs and
    rstds (model.family.saved_by_qk_norm); the inputs of the
    projections that train; each LoRA adapter's down-projection output [tokens, r] (and with dropout its
    own dropped-out input and mask instead of the shared input); and the MLP's input, or untiled its
    intermediates. Under autocast with bf16 activations, also autocast's bf16 copies of the fp32 adapter
    weights that the adapter products keep (2 bytes per adapter parameter of the projections above: for
    Llama-3-8B at r=16 0.8 MiB a layer with a tiled MLP, 2.5 MiB untiled; tiny but real). Llama-3-8B LoRA
    (r=16, no dropout) keeps 6.5 [tokens, hidden] activations, 6.5 times a checkpointed layer's kept input;
    a tiled MLP still recomputes its tiles in the backward. Sequence parallel over more than one rank
    (`shape.tokens` this rank's slice): the attention keeps its inputs and output in the exchanged layout,
    KV heads repeated up to the degree when fewer and query heads padded to a multiple of it
    (conf.schema.parallel.padded_query_heads), and o_proj's input is the output exchanged back: one more
    copy of the attention output (measured on 2 H200s: without it the plan ran out of memory)."""
    arch, act = shape.arch, shape.act_bytes
    d, kv = arch.hidden_size, max(arch.num_key_value_heads, sequence_parallel) * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim
    # the query heads attention runs on: padded to a multiple of the sequence-parallel degree
    heads = padded_query_heads(arch.num_attention_heads, arch.num_key_value_heads, sequence_parallel)
    per_token = act * (2 * d + 2 * heads * arch.head_dim + 2 * kv) + 4 * (2 + heads) + 2 * 4
    per_token += saved_by_qk_norm(arch, act)
    if sequence_parallel > 1:
        per_token += act * q
    # (names, input width, input already kept by another op): the attention output is o_proj's input.
    projections = [(("q_proj", "k_proj", "v_proj"), d, False), (("o_proj",), q, True)]
    if mlp_tiled:            # TokenTiled keeps the MLP's input only; its tiles run again in the backward
        per_token += act * d
    else:                    # gate and up, kept by the fused SwiGLU (kernels.swiglu recomputes silu)
        per_token += act * 2 * arch.intermediate_size
        projections += [(("gate_proj", "up_proj"), d, False), (("down_proj",), arch.intermediate_size, False)]
    mask_bytes = 1 if device_type == "cuda" else act      # CUDA keeps a bool mask, the CPU a noise tensor
    per_token += sum(_projection_inputs(train_cfg, names, width, kept, act, mask_bytes)
                     for names, width, kept in projections)
    # the projections whose products this forward records (a tiled MLP's run again in the backward)
    recorded = [name for names, _, _ in projections for name in names]
    return shape.tokens * per_token + _adapter_weight_copies(shape, train_cfg, recorded)


def _adapter_weight_copies(shape: Shape, train_cfg, names: list[str]) -> int:
    """Adapters are fp32 (trainer.build.apply_lora); with narrower activations autocast casts each adapter
    weight to their dtype for its product, and autograd keeps the copy for the input's gradient."""
    if train_cfg.mode != "lora" or shape.act_bytes == 4:
        return 0
    return shape.act_bytes * _adapter_parameters(shape.arch, train_cfg, names)


def _projection_inputs(train_cfg, names: tuple[str, ...], width: int, kept: bool, act: int, mask_bytes: int) -> int:
    """Per-token bytes that projections reading one input keep for their weight gradients: the input once
    (unless another op keeps it) for trained weights or dropout-free adapters; per adapter its [r] output,
    and with dropout its own dropped-out input and mask (a frozen base projection keeps nothing)."""
    if train_cfg.mode != "lora":
        return 0 if kept else act * width
    adapters = sum(name in train_cfg.lora_target_modules for name in names)
    if not adapters:
        return 0
    down = adapters * act * train_cfg.lora_r
    if train_cfg.lora_dropout > 0:
        return down + adapters * width * (act + mask_bytes)
    return down + (0 if kept else act * width)
