"""The memory policy: per-layer checkpointing with offloaded layer inputs, and sequence-tiled MLPs.

`apply_memory_policy(model, placements, mlp_tiles, device)` replaces `Decoder.run_layer` on the instance
(the model code knows nothing of this) and the MLPs' `forward`. Per checkpointed decoder layer, only its
input survives the forward; it is kept on the GPU, copied to pinned host memory on a side stream while the
next layer computes, or not kept at all and recomputed from the previous layer's input (`Placement` "gpu" /
"host" / "recompute"; offload.store defines and holds them); layer 0's, the token embedding's output, is looked up
again from the token ids ("embedding", recorded by a forward hook on the embedding). A "full" layer is not
checkpointed: plain autograd keeps its activations and its backward recomputes nothing but its tiled MLP's
tiles. The backward of a checkpointed layer i waits for its input, starts the host-to-GPU copy of the one
needed next, recomputes layer i with grad and back-propagates through it; LoRA parameters accumulate their
gradients there, as in reentrant checkpointing. Host buffers are pinned at the planner's sizes (`pin_buffers`).

Optionally (`attention` placements, "gpu" / "host" / "none" per layer, `offload.store.AttentionPlacement`)
a layer's attention output and log-sum-exp are kept too, through a `kernels.attention.attention_tape.AttentionTape`:
the recomputation then reuses them instead of running the attention forward again, the costliest part of a
long-sequence recompute.
A layer re-run to rebuild the recomputed input above it keeps that run's attention outputs the same way, for
its own backward next, in host memory its input no longer needs (`offload.store.rebuilds_attention`).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from kernels.attention.attention_tape import AttentionTape
from model import unwrap_model
from model.fp8 import Fp8Linear
from offload.byte_model import Shape
from offload.engine import CopyEngine
from offload.store import (AttentionPlacement, EmbeddingLookup, LayerInputStore, Placement, ReplayState,
                           attention_key, input_key)


def _row_ranges(rows: int, tiles: int) -> list[tuple[int, int]]:
    step = -(-rows // tiles)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


class TokenTiled(torch.autograd.Function):
    """y = fn(x) for a per-token fn, computed in row tiles of the flattened tokens; only x is saved and
    each tile is recomputed in the backward, so one tile's intermediates exist at a time.

    `unread` (the output's last dim and dtype) says that nothing will read y's values: the forward then
    computes nothing and returns an uninitialized y, as its backward recomputes every tile from x anyway.
    `backward_fn`, when given, is what the backward recomputes each tile with (fn, knowing that only the
    tile's graph is wanted)."""

    @staticmethod
    def forward(ctx, anchor, x, fn, tiles, unread: tuple[int, torch.dtype] | None = None, backward_fn=None):
        ctx.fn, ctx.tiles, ctx.replay = backward_fn or fn, tiles, ReplayState.capture(x.device)
        ctx.save_for_backward(x)
        if unread is not None:
            features, dtype = unread
            return torch.empty(*x.shape[:-1], features, dtype=dtype, device=x.device)
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
        return None, None if grad_x is None else grad_x.view_as(x), None, None, None, None


class UnreadOutputs:
    """The backward's recomputations rebuild autograd graphs whose output values nothing reads, and skip the
    products that would compute only those values:
      layer: a checkpointed layer recomputed for its backward. Its MLP's output is added to the residual
        stream for the layer's output alone, so the tiled MLP computes nothing there (TokenTiled's backward
        recomputes its tiles anyway): one of a checkpointed layer's three MLP passes saved.
      tile: an MLP tile recomputed in TokenTiled's backward. Its down projection's output is the tile's,
        whose backward needs the projection's input and weight only (UnreadLinear): one of the MLP's three
        products saved in every tile's recomputation."""

    def __init__(self):
        self.layer = self.tile = False

    @contextlib.contextmanager
    def during(self, name: str):
        setattr(self, name, True)
        try:
            yield
        finally:
            setattr(self, name, False)


class UnreadLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) whose value nothing reads: an uninitialized output of the dtype F.linear
    would give (autocast's), and the exact gradients of x, weight and bias."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        kind = x.device.type
        ctx.dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return torch.empty(*x.shape[:-1], weight.shape[0], dtype=ctx.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (rows @ weight.to(ctx.dtype)).view(*x.shape[:-1], weight.shape[1]).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (rows.t() @ x.reshape(-1, x.shape[-1]).to(ctx.dtype)).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias


class LinearUnlessUnread:
    """Replacement `forward` of an MLP's down projection (its nn.Linear or model.fp8.Fp8Linear, under a LoRA
    wrapper if any): UnreadLinear (or the FP8 product's unread forward) while a tile is recomputed for its
    backward, the projection's own forward otherwise."""

    def __init__(self, linear: nn.Linear, unread: UnreadOutputs):
        self.linear, self.forward, self.unread = linear, linear.forward, unread

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.unread.tile:
            if isinstance(self.linear, Fp8Linear):
                return self.linear.forward_unread(x)
            return UnreadLinear.apply(x, self.linear.weight, self.linear.bias)
        return self.forward(x)


class TiledForward:
    """Replacement `forward` of a per-token module (the MLP), installed when tiles > 1: always tiled, so a
    no-grad forward also has one tile's intermediates at a time; nothing computed where its output is
    `unread` (UnreadOutputs.layer), once a forward has shown the output's shape and dtype."""

    def __init__(self, forward, tiles: int, anchor: torch.Tensor, unread: UnreadOutputs):
        self.forward, self.tiles, self.anchor, self.unread = forward, tiles, anchor, unread
        self.output: tuple[int, torch.dtype] | None = None

    def _tile_for_backward(self, rows: torch.Tensor) -> torch.Tensor:
        with self.unread.during("tile"):
            return self.forward(rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        unread = self.output if self.unread.layer else None
        out = TokenTiled.apply(self.anchor, x, self.forward, self.tiles, unread, self._tile_for_backward)
        self.output = (out.shape[-1], out.dtype)
        return out


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
        hidden = policy.layer_input(index, ctx.rope, ctx.cu_seqlens).detach().requires_grad_(want_input_grad)
        tape = policy.store.take_attention(index)
        policy.store.prefetch_attention(index - 1, ahead=True)
        with (torch.enable_grad(), replay.replay(), tape.replaying() if tape else contextlib.nullcontext(),
              policy.unread.during("layer")):
            out = policy.layers[index](hidden, ctx.rope, ctx.cu_seqlens)
        if out.requires_grad:
            torch.autograd.backward(out, grad_out)
        policy.store.release(index)
        return None, hidden.grad if want_input_grad else None, None, None, None, None


class MemoryPolicy:
    """Installed on a Decoder by `apply_memory_policy`; `stats()` gives per-step offload metrics."""

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
        self.unread = UnreadOutputs()
        self.lookup_hook = None

    def install(self) -> "MemoryPolicy":
        if self.store is not None:
            self.decoder.run_layer = self.run_layer
            if Placement.EMBEDDING in self.store.placements:
                EmbeddingLookup.check_looked_up_again(self.decoder.embed_tokens)
                self.lookup_hook = self.decoder.embed_tokens.register_forward_hook(self.store.record_lookup)
        if self.mlp_tiles > 1:
            for layer in self.layers:
                layer.mlp.forward = TiledForward(layer.mlp.forward, self.mlp_tiles, self.anchor, self.unread)
                down = _down_projection(layer.mlp)
                down.forward = LinearUnlessUnread(down, self.unread)
        return self

    def remove(self) -> None:
        """Restore the plain model (and drop the pinned pool)."""
        self.decoder.__dict__.pop("run_layer", None)
        if self.lookup_hook is not None:
            self.lookup_hook.remove()
        for layer in self.layers:
            layer.mlp.__dict__.pop("forward", None)
            _down_projection(layer.mlp).__dict__.pop("forward", None)
        self.engine.pool.buffers.clear()

    def pin_buffers(self, shape: Shape) -> None:
        """Allocate the pinned buffers of the host-placed inputs and attention outputs now (~0.6 s/GiB), not
        in the first step, at the sizes the planner counted them with (`MemoryPlan.shape`)."""
        if self.store is None:
            return
        for index, placement in enumerate(self.store.placements):
            if placement == Placement.HOST:
                self.engine.pool.get(input_key(index), shape.activation)
            if self.store.attention[index] == AttentionPlacement.HOST:
                for part, size in enumerate(shape.attention_output):
                    self.engine.pool.get(attention_key(index, 0, part), size)

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, rope, cu_seqlens) -> torch.Tensor:
        index = self.index_of[id(layer)]
        if not torch.is_grad_enabled() or self.store.placements[index] == Placement.FULL:
            return layer(hidden, rope, cu_seqlens)      # "full": autograd keeps its activations, no recompute
        return OffloadedCheckpoint.apply(self.anchor, hidden, self, index, rope, cu_seqlens)

    def forward_layer(self, index: int, hidden: torch.Tensor, rope, cu_seqlens) -> torch.Tensor:
        """Layer `index`'s forward without grad, recording its attention outputs if they are to be kept."""
        return self._recording(index, hidden, rope, cu_seqlens, self.store.keeps_attention(index),
                               self.store.keep_attention)

    def _recording(self, index: int, hidden: torch.Tensor, rope, cu_seqlens, record: bool, keep) -> torch.Tensor:
        """Layer `index`'s forward, its attention outputs recorded and given to `keep` if `record`."""
        if not record:
            return self.layers[index](hidden, rope, cu_seqlens)
        tape = AttentionTape()
        with tape.recording():
            out = self.layers[index](hidden, rope, cu_seqlens)
        keep(index, tape)
        return out

    def layer_input(self, index: int, rope, cu_seqlens) -> torch.Tensor:
        """Layer `index`'s input for its backward: fetched, or rebuilt by re-running the layer below."""
        source = self.store.source(index)
        hidden = self.store.take(source)        # its copy first: the compute stream waits for it alone
        # Then this layer's kept attention outputs where the layer above did not start their copy (the plan has
        # room for them there, `copied_back_ahead`, or not: the first backward, a recomputed input's own, a
        # rebuilt one), ahead of the input below, which the compute stream would otherwise wait for too.
        self.store.prefetch_attention(index)
        self.store.prefetch_below(source)       # then the next input, overlapping this layer's backward
        if source == index:
            return hidden
        with torch.no_grad(), self.store.replay_state(source).replay():
            return self._recording(source, hidden, rope, cu_seqlens, self.store.rebuilds_attention(source),
                                   self.store.keep_rebuilt_attention)

    def stats(self) -> dict[str, float]:
        """Offload metrics since the last call (pinned GiB, copy GB/s, hidden copy fraction)."""
        return self.engine.take_stats()


def _down_projection(mlp: nn.Module) -> nn.Module:
    """The nn.Linear (or Fp8Linear) of an MLP's down projection: peft's LoRA layer wraps it as base_layer."""
    return getattr(mlp.down_proj, "base_layer", mlp.down_proj)


def apply_memory_policy(model: nn.Module, placements: list[str] | None, mlp_tiles: int,
                        device: torch.device, attention: list[str] | None = None) -> MemoryPolicy:
    """Install checkpointing (placements per layer, None = off), kept attention outputs (per layer, None =
    none) and MLP tiling (tiles > 1) on `model`. Placements are members of offload.store's Placement and
    AttentionPlacement, or their strings."""
    decoder = unwrap_model(model).model        # the Decoder inside a CausalLM, possibly wrapped by peft
    return MemoryPolicy(decoder, placements, mlp_tiles, device, attention).install()
