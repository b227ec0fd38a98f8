"""The memory policy: per-layer checkpointing with offloaded layer inputs, and sequence-tiled MLPs.

`apply_memory_policy(model, placements, mlp_tiles, device)` replaces `LlamaModel.run_layer` on the instance
(the model code knows nothing of this) and the MLPs' `forward`. Per checkpointed decoder layer, only its
input survives the forward; it is kept on the GPU, copied to pinned host memory on a side stream while the
next layer computes, or not kept at all and recomputed from the previous layer's input ("gpu" / "host" /
"recompute" placements; offload.store holds them). A "full" layer is not checkpointed: plain autograd
keeps its activations and its backward recomputes nothing but its tiled MLP's tiles. The backward of a
checkpointed layer i waits for its input, starts the host-to-GPU copy of the one needed next, recomputes
layer i with grad and back-propagates through it; LoRA parameters accumulate their gradients there, as in
reentrant checkpointing. Host buffers are pinned at the planner's sizes (`pin_buffers`).

Optionally (`attention` placements, "gpu" / "host" / "none" per layer) a layer's attention output and
log-sum-exp are kept too, through a `kernels.attention_tape.AttentionTape`: the recomputation then reuses
them instead of running the attention forward again, the costliest part of a long-sequence recompute.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from kernels.attention_tape import AttentionTape
from model import unwrap_llama
from offload.byte_model import Shape
from offload.engine import CopyEngine
from offload.store import LayerInputStore, ReplayState, attention_key, input_key


def _row_ranges(rows: int, tiles: int) -> list[tuple[int, int]]:
    step = -(-rows // tiles)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


class TokenTiled(torch.autograd.Function):
    """y = fn(x) for a per-token fn, computed in row tiles of the flattened tokens; only x is saved and
    each tile is recomputed in the backward, so one tile's intermediates exist at a time."""

    @staticmethod
    def forward(ctx, anchor, x, fn, tiles):
        ctx.fn, ctx.tiles, ctx.replay = fn, tiles, ReplayState.capture(x.device)
        ctx.save_for_backward(x)
        rows = x.view(-1, x.shape[-1])              # a view: a non-contiguous x is an error, never a copy
        out = None
        for start, end in _row_ranges(rows.shape[0], tiles):
            tile_out = fn(rows[start:end])
            if out is None:
                out = tile_out.new_empty(rows.shape[0], tile_out.shape[-1])
            out[start:end] = tile_out
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, = ctx.saved_tensors
        rows, grad_rows = x.view(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        want_input_grad = ctx.needs_input_grad[1]
        grad_x = torch.empty_like(rows) if want_input_grad else None
        with torch.enable_grad(), ctx.replay.replay():
            for start, end in _row_ranges(rows.shape[0], ctx.tiles):
                tile = rows[start:end].detach().requires_grad_(want_input_grad)
                tile_out = ctx.fn(tile)
                if tile_out.requires_grad:
                    torch.autograd.backward(tile_out, grad_rows[start:end])
                if want_input_grad:
                    grad_x[start:end] = tile.grad
        return None, None if grad_x is None else grad_x.view_as(x), None, None


class TiledForward:
    """Replacement `forward` of a per-token module (the MLP), installed when tiles > 1: always tiled, so a
    no-grad forward also has one tile's intermediates at a time."""

    def __init__(self, forward, tiles: int, anchor: torch.Tensor):
        self.forward, self.tiles, self.anchor = forward, tiles, anchor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return TokenTiled.apply(self.anchor, x, self.forward, self.tiles)


class OffloadedCheckpoint(torch.autograd.Function):
    """One decoder layer that keeps only its input (through the store) and recomputes itself in backward."""

    @staticmethod
    def forward(ctx, anchor, hidden, policy, index, rope, cu_seqlens):
        ctx.policy, ctx.index, ctx.rope, ctx.cu_seqlens = policy, index, rope, cu_seqlens
        ctx.token = policy.store.keep(index, hidden)
        return policy.forward_layer(index, hidden, rope, cu_seqlens)

    @staticmethod
    def backward(ctx, grad_out):
        policy, index = ctx.policy, ctx.index
        policy.store.check_owner(index, ctx.token)
        replay = policy.store.replay_state(index)
        want_input_grad = ctx.needs_input_grad[1]
        # Started by the layer above, except in the first backward: start it here, ahead of the prefetch of
        # the input below, which the compute stream would otherwise wait for too.
        policy.store.prefetch_attention(index)
        hidden = policy.layer_input(index, ctx.rope, ctx.cu_seqlens).detach().requires_grad_(want_input_grad)
        tape = policy.store.take_attention(index)
        policy.store.prefetch_attention(index - 1)
        with torch.enable_grad(), replay.replay(), tape.replaying() if tape else contextlib.nullcontext():
            out = policy.layers[index](hidden, ctx.rope, ctx.cu_seqlens)
        if out.requires_grad:
            torch.autograd.backward(out, grad_out)
        policy.store.release(index)
        return None, hidden.grad if want_input_grad else None, None, None, None, None


class MemoryPolicy:
    """Installed on a LlamaModel by `apply_memory_policy`; `stats()` gives per-step offload metrics."""

    def __init__(self, decoder: nn.Module, placements: list[str] | None, mlp_tiles: int, device: torch.device,
                 attention: list[str] | None = None):
        self.decoder = decoder
        self.layers = list(decoder.layers)
        self.index_of = {id(layer): i for i, layer in enumerate(self.layers)}
        self.engine = CopyEngine(device)
        self.store = LayerInputStore(placements, self.engine, attention) if placements is not None else None
        # Custom Functions run their backward only if some input needs grad; layer 0's input (a frozen
        # embedding's output) does not, so every call also takes this one.
        self.anchor = torch.empty(0, requires_grad=True)
        self.mlp_tiles = mlp_tiles

    def install(self) -> "MemoryPolicy":
        if self.store is not None:
            self.decoder.run_layer = self.run_layer
        if self.mlp_tiles > 1:
            for layer in self.layers:
                layer.mlp.forward = TiledForward(layer.mlp.forward, self.mlp_tiles, self.anchor)
        return self

    def remove(self) -> None:
        """Restore the plain model (and drop the pinned pool)."""
        self.decoder.__dict__.pop("run_layer", None)
        for layer in self.layers:
            layer.mlp.__dict__.pop("forward", None)
        self.engine.pool.buffers.clear()

    def pin_buffers(self, shape: Shape) -> None:
        """Allocate the pinned buffers of the host-placed inputs and attention outputs now (~0.6 s/GiB), not
        in the first step, at the sizes the planner counted them with (`MemoryPlan.shape`)."""
        if self.store is None:
            return
        for index, placement in enumerate(self.store.placements):
            if placement == "host":
                self.engine.pool.get(input_key(index), shape.activation)
            if self.store.attention[index] == "host":
                for part, size in enumerate(shape.attention_output):
                    self.engine.pool.get(attention_key(index, 0, part), size)

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, rope, cu_seqlens) -> torch.Tensor:
        index = self.index_of[id(layer)]
        if not torch.is_grad_enabled() or self.store.placements[index] == "full":
            return layer(hidden, rope, cu_seqlens)      # "full": autograd keeps its activations, no recompute
        return OffloadedCheckpoint.apply(self.anchor, hidden, self, index, rope, cu_seqlens)

    def forward_layer(self, index: int, hidden: torch.Tensor, rope, cu_seqlens) -> torch.Tensor:
        """Layer `index`'s forward without grad, recording its attention outputs if they are to be kept."""
        if not self.store.keeps_attention(index):
            return self.layers[index](hidden, rope, cu_seqlens)
        tape = AttentionTape()
        with tape.recording():
            out = self.layers[index](hidden, rope, cu_seqlens)
        self.store.keep_attention(index, tape)
        return out

    def layer_input(self, index: int, rope, cu_seqlens) -> torch.Tensor:
        """Layer `index`'s input for its backward: fetched, or rebuilt by re-running the layer below."""
        source = self.store.source(index)
        hidden = self.store.take(source)        # its copy first: the compute stream waits for it alone
        self.store.prefetch_below(source)       # then the next one, overlapping this layer's backward
        if source == index:
            return hidden
        with torch.no_grad(), self.store.replay_state(source).replay():
            return self.layers[source](hidden, rope, cu_seqlens)

    def stats(self) -> dict[str, float]:
        """Offload metrics since the last call (pinned GiB, copy GB/s, hidden copy fraction)."""
        return self.engine.take_stats()


def apply_memory_policy(model: nn.Module, placements: list[str] | None, mlp_tiles: int,
                        device: torch.device, attention: list[str] | None = None) -> MemoryPolicy:
    """Install checkpointing (placements per layer, None = off), kept attention outputs (per layer, None =
    none) and MLP tiling (tiles > 1) on `model`."""
    decoder = unwrap_llama(model).model        # the LlamaModel inside a Llama, possibly wrapped by peft
    return MemoryPolicy(decoder, placements, mlp_tiles, device, attention).install()
