"""Where each decoder layer's input (and its kept attention outputs) lives between its forward and its
backward: on the GPU, in pinned host memory (copied on the copy engine's side stream), or nowhere
("recompute": rebuilt from the layer below's input; "embedding", layer 0's: the token embedding's lookup,
done again from the token ids), plus the autocast and RNG state that lets a recomputation compute what the
forward did. `offload.policy` drives it. A "full" layer is not checkpointed at all: plain autograd keeps
its activations, so the store holds nothing for it.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from kernels.attention_tape import AttentionTape
from offload.engine import CopyEngine, HostCopy, PendingTensor


class _PrintedAsValue(str, Enum):
    """A str-valued enum whose members print as their values (str, format and repr, alike on every Python
    version): plans, messages and the lists in them read as the plain strings did, and a member equals its
    string."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)


class Placement(_PrintedAsValue):
    """Where a decoder layer's input is kept from its forward to its backward (the planner's choice per layer)."""
    GPU = "gpu"
    HOST = "host"                # pinned host memory, copied on the copy engine's side stream
    RECOMPUTE = "recompute"      # not kept: rebuilt from the layer below's input
    FULL = "full"                # not checkpointed: autograd keeps every activation, the store nothing
    EMBEDDING = "embedding"      # layer 0's only: the token embedding's lookup, done again from the token ids


class AttentionPlacement(_PrintedAsValue):
    """Where a checkpointed layer's attention output is kept for its recomputation to replay, or NONE."""
    GPU = "gpu"
    HOST = "host"
    NONE = "none"


# Placements whose input the store keeps (or looks up again): a "recompute" layer is rebuilt from the layer below's.
KEPT = (Placement.GPU, Placement.HOST, Placement.EMBEDDING)


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


def input_key(index: int) -> tuple[str, int]:
    """The pinned-pool key of layer `index`'s input."""
    return ("layer_input", index)


def attention_key(index: int, call: int, part: int) -> tuple[str, int, int, int]:
    """The pinned-pool key of layer `index`'s attention call `call`, part 0 (output) or 1 (lse)."""
    return ("attention", index, call, part)


def rebuilds_attention(placements: list[Placement], attention: list[AttentionPlacement], index: int) -> bool:
    """Whether layer `index`, whose forward is run again in the backward to rebuild the recomputed input of
    the layer above, keeps that forward's attention outputs for its own backward, which comes next: its
    recomputation then replays them instead of running its attention forward a third time (one attention
    forward per recomputed input: at 524k tokens, 3.5 s each). Its attention output goes where its input was
    kept on the host, a buffer idle once that input is back on the GPU (the attention output of a Llama is the
    size of a layer input); its lse (1/32 of that at head dim 128) stays on the GPU, where the plan counts one."""
    return (placements[index] == Placement.HOST and attention[index] == AttentionPlacement.NONE
            and placements[index + 1:index + 2] == [Placement.RECOMPUTE])


def copied_back_ahead(placements: list[Placement], attention: list[AttentionPlacement], index: int) -> bool:
    """Whether layer `index`'s host-kept attention output is copied back during the backward of the layer
    above, into a GPU slot the plan counts there. A recomputed input's own output is not: its copy back
    starts in its own backward, hidden behind the forward that rebuilds its input, and needs no such slot."""
    return attention[index] == AttentionPlacement.HOST and placements[index] != Placement.RECOMPUTE


@dataclass(eq=False)
class EmbeddingLookup:
    """Layer 0's input as the token embedding's lookup of `ids`, done again when its backward needs it (a
    gather writing one layer input, against keeping that input through the step). A plain nn.Embedding only
    (`check_looked_up_again`): a wrapper's forward (a LoRA adapter on it) would add what this lookup does not."""
    embedding: torch.nn.Embedding
    ids: torch.Tensor

    @staticmethod
    def check_looked_up_again(embedding: torch.nn.Module) -> None:
        """Raise ValueError unless a lookup done again gives what `embedding`'s forward gave."""
        if type(embedding) is not torch.nn.Embedding or embedding.max_norm is not None:
            raise ValueError(f"layer 0's input is placed 'embedding' (looked up again in its backward), which needs "
                             f"a plain nn.Embedding without max_norm, not {type(embedding).__name__}: place it 'gpu' "
                             "or 'host' (the planner does where the embedding trains an adapter)")

    def tensor(self) -> torch.Tensor:
        with torch.no_grad():       # the forward's lookup keeps the autograd node the gradient flows to
            return torch.nn.functional.embedding(self.ids, self.embedding.weight, self.embedding.padding_idx)


Payload = torch.Tensor | HostCopy | PendingTensor | EmbeddingLookup


def _started(payload: Payload, engine: CopyEngine) -> Payload:
    """A host-held payload with its copy back to the device started; others as they are."""
    return engine.to_device(payload) if isinstance(payload, HostCopy) else payload


def _on_device(payload: Payload, engine: CopyEngine) -> torch.Tensor:
    """The payload on the device, the current stream waiting for its copy if one is in flight (or looked up
    again from the embedding)."""
    if isinstance(payload, EmbeddingLookup):
        return payload.tensor()
    payload = _started(payload, engine)
    return payload.wait() if isinstance(payload, PendingTensor) else payload


def _when_replayed(payload: Payload) -> torch.Tensor | Callable[[], torch.Tensor]:
    """A started payload as an attention tape entry: a copy in flight is waited for by the call replaying it."""
    return payload.wait if isinstance(payload, PendingTensor) else payload


def check_placements(placements: list[str], attention: list[str]) -> None:
    """Raise ValueError for a layout the store cannot serve (members of Placement and AttentionPlacement, or
    their strings)."""
    unknown = set(placements) - set(Placement)
    if unknown:
        raise ValueError(f"placements must be among {tuple(Placement)}, got {sorted(unknown)}")
    if len(attention) != len(placements) or set(attention) - set(AttentionPlacement):
        raise ValueError(f"attention placements must be one of {tuple(AttentionPlacement)} per layer "
                         f"({len(placements)}), got {attention}")
    if any(p == Placement.RECOMPUTE and (i == 0 or placements[i - 1] not in KEPT) for i, p in enumerate(placements)):
        raise ValueError("a 'recompute' layer needs the previous layer's input kept (gpu, host or embedding): not "
                         f"layer 0, never above a 'recompute' or 'full' layer; got {placements}")
    if Placement.EMBEDDING in placements[1:]:
        raise ValueError(f"only layer 0's input is the token embedding's output ('embedding'); got {placements}")
    if any(p == Placement.FULL and a != AttentionPlacement.NONE for p, a in zip(placements, attention)):
        raise ValueError("a 'full' layer is never recomputed, so its attention placement must be 'none'; got "
                         f"placements {placements}, attention {attention}")


@dataclass(eq=False)
class StoredInput:
    placement: Placement
    payload: Payload | None
    replay: ReplayState
    # "recompute": the token of the layer below's record, kept by the same forward, this input is rebuilt from.
    below: object | None = None
    # Identifies this forward's record to its backward. The autograd node holds only this token, never the
    # record: a node outlives its backward (until the loss is freed) and would keep the payload alive.
    token: object = field(default_factory=object)
    # The layer's (out, lse) attention payloads, when its attention placement keeps them (or its rebuilding
    # forward did: `rebuilds_attention`).
    attention: list[tuple[Payload, Payload]] = field(default_factory=list)


class LayerInputStore:
    """Holds each layer's input (and, where placed, its attention outputs) from its forward to its backward,
    and prefetches in the backward."""

    def __init__(self, placements: list[str], engine: CopyEngine, attention: list[str] | None = None):
        """`placements` and `attention` per layer: members of Placement and AttentionPlacement, or their
        strings, which are taken as those members."""
        attention = attention or [AttentionPlacement.NONE] * len(placements)
        check_placements(placements, attention)
        self.placements = [Placement(p) for p in placements]
        self.attention = [AttentionPlacement(a) for a in attention]
        self.engine = engine
        self.stored: dict[int, StoredInput] = {}
        # The embedding's last lookup, its output (weakly) and that output's version (`record_lookup`), for an
        # "embedding" layer 0.
        self.lookup: tuple[EmbeddingLookup, weakref.ref, int] | None = None

    def record_lookup(self, embedding: torch.nn.Embedding, args: tuple, output: torch.Tensor) -> None:
        """Forward hook of the model's token embedding: what layer 0's "embedding" placement looks up again."""
        self.lookup = EmbeddingLookup(embedding, args[0]), weakref.ref(output), output._version

    def keep(self, index: int, hidden: torch.Tensor) -> object:
        """Keep layer `index`'s input (replacing what an earlier forward kept for it); returns the token its
        backward gives `check_owner`."""
        placement = self.placements[index]
        payload = None                                   # RECOMPUTE: nothing kept
        if placement == Placement.GPU:
            payload = hidden.detach()
        elif placement == Placement.HOST:
            payload = self.engine.to_host(input_key(index), hidden.detach())
        elif placement == Placement.EMBEDDING:
            payload = self._looked_up(hidden)
        below = self.stored[index - 1].token if placement == Placement.RECOMPUTE else None
        record = StoredInput(placement, payload, ReplayState.capture(hidden.device), below)
        self.stored[index] = record
        return record.token

    def _looked_up(self, hidden: torch.Tensor) -> EmbeddingLookup:
        """The lookup whose output `hidden` is (layer 0's input), taken: refused for any other tensor, or that
        output changed in place since, which the lookup would not give back."""
        lookup, self.lookup = self.lookup, None
        if lookup is None or lookup[1]() is not hidden or hidden._version != lookup[2]:
            raise RuntimeError("layer 0's input is placed 'embedding' (looked up again from the token ids in the "
                               "backward), but it is not the output of the model's token embedding in this forward: "
                               "place it 'gpu' or 'host'")
        return lookup[0]

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
        return index - 1 if self.placements[index] == Placement.RECOMPUTE else index

    def take(self, index: int) -> torch.Tensor:
        """The input of layer `index` on the device, waiting for its copy if one is in flight."""
        record = self.stored[index]
        record.payload = _on_device(record.payload, self.engine)
        return record.payload

    def keeps_attention(self, index: int) -> bool:
        return self.attention[index] != AttentionPlacement.NONE

    def keep_attention(self, index: int, tape: AttentionTape) -> None:
        """Keep what layer `index`'s forward recorded on `tape`, where its attention placement says."""
        on_host = self.attention[index] == AttentionPlacement.HOST
        self.stored[index].attention = [
            tuple(self.engine.to_host(attention_key(index, call, part), t) if on_host else t
                  for part, t in enumerate(pair)) for call, pair in enumerate(tape.saved)]

    def rebuilds_attention(self, index: int) -> bool:
        return rebuilds_attention(self.placements, self.attention, index)

    def keep_rebuilt_attention(self, index: int, tape: AttentionTape) -> None:
        """Keep what layer `index` recorded while rebuilding the input above it (`rebuilds_attention`): the
        output in its own input's pinned buffer (that input's copy back out of it runs first: the copy
        stream is in order), only where it fits there (never a new buffer of that size, which the plan does not
        count), the lse as it is, on the GPU."""
        if len(tape.saved) != 1:       # one attention call per layer is what the buffer is sized for
            return
        out, lse = tape.saved[0]
        out_host = self.engine.into_existing(input_key(index), out)
        if out_host is not None:
            self.stored[index].attention = [(out_host, lse)]

    def take_attention(self, index: int) -> AttentionTape | None:
        """Layer `index`'s kept attention outputs as a tape to replay (None: none kept), their copies back started:
        the compute stream waits for each when the attention call replaying it comes (`_when_replayed`)."""
        record = self.stored[index]
        if not record.attention:
            return None
        self._start_attention_copies(record)
        return AttentionTape([tuple(map(_when_replayed, pair)) for pair in record.attention])

    def prefetch_attention(self, index: int, ahead: bool = False) -> None:
        """Start copying back layer `index`'s kept attention outputs (its backward comes next). `ahead`: asked
        during the backward of the layer above, which copies back only those the plan counts GPU room for
        there (`copied_back_ahead`; rebuilt ones, whose placement is "none", are not): the others wait for their
        own layer's backward."""
        record = self.stored.get(index)
        if record is not None and (not ahead or copied_back_ahead(self.placements, self.attention, index)):
            self._start_attention_copies(record)

    def _start_attention_copies(self, record: StoredInput) -> None:
        """Start the copies back of `record`'s host-kept attention outputs (once: started ones stay as they are)."""
        record.attention = [tuple(_started(p, self.engine) for p in pair) for pair in record.attention]

    def release(self, index: int) -> None:
        """Layer `index`'s backward is done: its input is no longer needed."""
        self.stored.pop(index, None)

    def prefetch_below(self, index: int) -> None:
        """Start copying back the next kept input below `index`, to overlap this layer's backward."""
        below = [i for i in self.stored if i < index and self.stored[i].placement != Placement.RECOMPUTE]
        if below:
            record = self.stored[max(below)]
            record.payload = _started(record.payload, self.engine)
