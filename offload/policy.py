"""The memory policy: per-layer checkpointing with offloaded layer inputs, and sequence-tiled MLPs.

`apply_memory_policy(model, placements, mlp_tiles, device)` replaces `LlamaModel.run_layer` on the instance
(the model code knows nothing of this) and the MLPs' `forward`. Per decoder layer, only its input survives
the forward; it is kept on the GPU, copied to pinned host memory on a side stream while the next layer
computes, or not kept at all and recomputed from the previous layer's input ("gpu" / "host" / "recompute"
placements). The backward of layer i waits for its input, starts the host-to-GPU copy of the one needed
next, recomputes layer i with grad and back-propagates through it; LoRA parameters accumulate their
gradients there, as in reentrant checkpointing. Host buffers are pinned at the planner's sizes
(`pin_buffers`).

Optionally (`attention` placements, "gpu" / "host" / "none" per layer) a layer's attention output and
log-sum-exp are kept too, through a `kernels.attention_tape.AttentionTape`: the recomputation then reuses
them instead of running the attention forward again, the costliest part of a long-sequence recompute.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.attention_tape import AttentionTape
from model import unwrap_llama
from offload.byte_model import Shape
from offload.engine import CopyEngine, HostCopy, PendingTensor

PLACEMENTS = ("gpu", "host", "recompute")
ATTENTION_PLACEMENTS = ("gpu", "host", "none")


@dataclass
class ReplayState:
    """Autocast and RNG state of a forward, so its recomputation computes the same values (dropout too)."""
    device: torch.device
    autocast: bool
    autocast_dtype: torch.dtype
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> "ReplayState":
        kind = device.type
        return cls(device, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                   torch.get_rng_state(), torch.cuda.get_rng_state(device) if kind == "cuda" else None)

    @contextlib.contextmanager
    def replay(self):
        devices = [self.device] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast):
                yield


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


def input_key(index: int) -> tuple[str, int]:
    """The pinned-pool key of layer `index`'s input."""
    return ("layer_input", index)


def attention_key(index: int, call: int, part: int) -> tuple[str, int, int, int]:
    """The pinned-pool key of layer `index`'s attention call `call`, part 0 (output) or 1 (lse)."""
    return ("attention", index, call, part)


Payload = torch.Tensor | HostCopy | PendingTensor


def _started(payload: Payload, engine: CopyEngine) -> Payload:
    """A host-held payload with its copy back to the device started; others as they are."""
    return engine.to_device(payload) if isinstance(payload, HostCopy) else payload


def _on_device(payload: Payload, engine: CopyEngine) -> torch.Tensor:
    """The payload on the device, the current stream waiting for its copy if one is in flight."""
    payload = _started(payload, engine)
    return payload.wait() if isinstance(payload, PendingTensor) else payload


@dataclass(eq=False)
class StoredInput:
    placement: str
    payload: Payload | None
    replay: ReplayState
    # "recompute": the token of the layer below's record, kept by the same forward, this input is rebuilt from.
    below: object | None = None
    # Identifies this forward's record to its backward. The autograd node holds only this token, never the
    # record: a node outlives its backward (until the loss is freed) and would keep the payload alive.
    token: object = field(default_factory=object)
    # The layer's (out, lse) attention payloads, when its attention placement keeps them.
    attention: list[tuple[Payload, Payload]] = field(default_factory=list)


class LayerInputStore:
    """Holds each layer's input (and, where placed, its attention outputs) from its forward to its backward,
    and prefetches in the backward."""

    def __init__(self, placements: list[str], engine: CopyEngine, attention: list[str] | None = None):
        unknown = set(placements) - set(PLACEMENTS)
        if unknown:
            raise ValueError(f"placements must be among {PLACEMENTS}, got {sorted(unknown)}")
        attention = attention or ["none"] * len(placements)
        if len(attention) != len(placements) or set(attention) - set(ATTENTION_PLACEMENTS):
            raise ValueError(f"attention placements must be one of {ATTENTION_PLACEMENTS} per layer "
                             f"({len(placements)}), got {attention}")
        if placements and placements[0] == "recompute" or any(
                a == b == "recompute" for a, b in zip(placements, placements[1:])):
            raise ValueError("a 'recompute' layer needs the previous layer's input kept: not layer 0, never two "
                             f"in a row; got {placements}")
        self.placements, self.attention, self.engine = placements, attention, engine
        self.stored: dict[int, StoredInput] = {}

    def keep(self, index: int, hidden: torch.Tensor) -> object:
        """Keep layer `index`'s input (replacing what an earlier forward kept for it); returns the token its
        backward gives `check_owner`."""
        placement = self.placements[index]
        payload = None                                   # "recompute": nothing kept
        if placement == "gpu":
            payload = hidden.detach()
        elif placement == "host":
            payload = self.engine.to_host(input_key(index), hidden.detach())
        below = self.stored[index - 1].token if placement == "recompute" else None
        record = StoredInput(placement, payload, ReplayState.capture(hidden.device), below)
        self.stored[index] = record
        return record.token

    def check_owner(self, index: int, token: object) -> None:
        """Refuse a backward whose kept input (or the one it is rebuilt from) is no longer its forward's: the
        store holds one input per layer, so a second forward with grad replaces the first's, and a backward
        releases them (silently wrong gradients otherwise)."""
        record, below = self.stored.get(index), self.stored.get(index - 1)
        if record is None or record.token is not token or (
                record.below is not None and (below is None or below.token is not record.below)):
            raise RuntimeError(
                f"layer {index}'s kept input is gone: the memory policy keeps one forward's layer inputs, so each "
                "forward with grad needs its own backward before the next forward with grad, and only one "
                "backward (no retain_graph). Run backward after each forward (gradient accumulation), run the "
                "other forwards under torch.no_grad(), or set memory.checkpoint=false.")

    def replay_state(self, index: int) -> ReplayState:
        return self.stored[index].replay

    def source(self, index: int) -> int:
        """The layer whose kept input the input of `index` is rebuilt from."""
        return index - 1 if self.placements[index] == "recompute" else index

    def take(self, index: int) -> torch.Tensor:
        """The input of layer `index` on the device, waiting for its copy if one is in flight."""
        record = self.stored[index]
        record.payload = _on_device(record.payload, self.engine)
        return record.payload

    def keeps_attention(self, index: int) -> bool:
        return self.attention[index] != "none"

    def keep_attention(self, index: int, tape: AttentionTape) -> None:
        """Keep what layer `index`'s forward recorded on `tape`, where its attention placement says."""
        on_host = self.attention[index] == "host"
        self.stored[index].attention = [
            tuple(self.engine.to_host(attention_key(index, call, part), t) if on_host else t
                  for part, t in enumerate(pair)) for call, pair in enumerate(tape.saved)]

    def take_attention(self, index: int) -> AttentionTape | None:
        """Layer `index`'s kept attention outputs on the device as a tape to replay (None: none kept)."""
        record = self.stored[index]
        if not record.attention:
            return None
        record.attention = [tuple(_on_device(p, self.engine) for p in pair) for pair in record.attention]
        return AttentionTape(list(record.attention))

    def prefetch_attention(self, index: int) -> None:
        """Start copying back layer `index`'s kept attention outputs (its backward comes next)."""
        record = self.stored.get(index)
        if record is not None:
            record.attention = [tuple(_started(p, self.engine) for p in pair) for pair in record.attention]

    def release(self, index: int) -> None:
        """Layer `index`'s backward is done: its input is no longer needed."""
        self.stored.pop(index, None)

    def prefetch_below(self, index: int) -> None:
        """Start copying back the next kept input below `index`, to overlap this layer's backward."""
        below = [i for i in self.stored if i < index and self.stored[i].placement != "recompute"]
        if below:
            record = self.stored[max(below)]
            record.payload = _started(record.payload, self.engine)


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
        if not torch.is_grad_enabled():
            return layer(hidden, rope, cu_seqlens)
        return OffloadedCheckpoint.apply(self.anchor, hidden, self, self.index_of[id(layer)], rope, cu_seqlens)

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
