"""Asynchronous device<->host copies into a pinned buffer pool that is allocated once and reused.

Reusable alone (trainer.streamed_adamw keeps full fine-tuning's gradients in one too):

    engine = CopyEngine(torch.device("cuda"))
    stored = engine.to_host("layer3", x)          # returns at once; the copy runs on engine.stream
    ...
    back = engine.to_device(stored)               # starts the H2D copy, returns a pending tensor
    y = back.wait()                               # the current stream waits for the copy, not the host

Pinning costs ~0.6 s/GiB, so a buffer is allocated the first time its key is seen and reused for every
later copy under that key (it grows only if a larger tensor arrives). Many small tensors share one
buffer carved into views (`PinnedPool.carve`), since the pinned allocator rounds every allocation up to a
power of two; `copy_to_host` copies into such a view. On CPU the same API copies host-to-host
synchronously, so the callers' logic runs and is tested without CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offload.units import GIB

# Carved views start on this boundary, so every copy is aligned for the DMA engine.
ALIGNMENT = 64


class PinnedPool:
    """Host byte buffers keyed by name, page-locked when CUDA is present, never freed while the pool lives."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict[object, torch.Tensor] = {}

    def get(self, key: object, nbytes: int) -> torch.Tensor:
        buffer = self.existing(key, nbytes)
        if buffer is None:
            self.buffers.pop(key, None)         # release the smaller one before pinning its replacement
            buffer = self.buffers[key] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return buffer

    def existing(self, key: object, nbytes: int) -> torch.Tensor | None:
        """The buffer of `key` if one of at least `nbytes` is pinned already (its first `nbytes`), else None:
        nothing is allocated."""
        buffer = self.buffers.get(key)
        return buffer[:nbytes] if buffer is not None and buffer.numel() >= nbytes else None

    def carve(self, key: object, likes: list[torch.Tensor]) -> list[torch.Tensor]:
        """One buffer under `key` carved into a view shaped and typed like each of `likes`, each starting on
        an ALIGNMENT boundary: one allocation instead of one per tensor, each rounded up to a power of two."""
        offsets, total = [], 0
        for like in likes:
            offsets.append(total)
            total += -(-_nbytes(like) // ALIGNMENT) * ALIGNMENT
        buffer = self.get(key, total)
        return [_typed_view(buffer[start:start + _nbytes(like)], like) for like, start in zip(likes, offsets)]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _typed_view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return buffer.view(like.dtype).view(like.shape)


@dataclass
class HostCopy:
    """A tensor's bytes in the pool (the copy may still be in flight on the copy stream)."""
    host: torch.Tensor
    device: torch.device


@dataclass
class PendingTensor:
    """A device tensor whose H2D copy was started; `wait()` orders the current stream after it."""
    tensor: torch.Tensor
    done: torch.cuda.Event | None
    engine: "CopyEngine"

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.engine.wait_on_current_stream(self.done)
            self.done = None
        return self.tensor


@dataclass
class CopyStats:
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    timings: list = field(default_factory=list)      # (start, end, nbytes) copy-stream events
    stalls: list = field(default_factory=list)       # (before, after) compute-stream events around waits


class CopyEngine:
    """One side stream for all copies (D2H mostly in the forward, H2D in the backward, where a layer's
    rebuilding forward also copies its attention output out), so copies overlap compute and stay ordered among
    themselves."""

    def __init__(self, device: torch.device, timed: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pool = PinnedPool(pin=self.cuda)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.timed = timed and self.cuda
        self.stats = CopyStats()

    def to_host(self, key: object, tensor: torch.Tensor) -> HostCopy:
        """Copy `tensor` into the pool buffer of `key`."""
        return self.copy_to_host(_typed_view(self.pool.get(key, _nbytes(tensor)), tensor), tensor)

    def into_existing(self, key: object, tensor: torch.Tensor) -> HostCopy | None:
        """Copy `tensor` into the pool buffer of `key` if one large enough is there already; None (no copy, no
        allocation) otherwise."""
        buffer = self.pool.existing(key, _nbytes(tensor))
        return None if buffer is None else self.copy_to_host(_typed_view(buffer, tensor), tensor)

    def copy_to_host(self, host: torch.Tensor, tensor: torch.Tensor) -> HostCopy:
        """Copy `tensor` into `host`, pool memory shaped like it (a carved view); the caller may drop
        `tensor` at once."""
        nbytes = _nbytes(tensor)
        self.stats.d2h_bytes += nbytes
        if not self.cuda:
            host.copy_(tensor)
            return HostCopy(host, tensor.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._timed_copy(host, tensor, nbytes)
        # The compute stream may free `tensor` right away; keep its memory until the copy has read it.
        tensor.record_stream(self.stream)
        return HostCopy(host, tensor.device)

    def to_device(self, stored: HostCopy) -> PendingTensor:
        nbytes = _nbytes(stored.host)
        self.stats.h2d_bytes += nbytes
        if not self.cuda:
            return PendingTensor(stored.host.clone(), None, self)
        # Allocated on the compute stream, which owns and frees it; the copy stream first waits for the
        # compute stream so the block's previous owner is done with it.
        tensor = torch.empty_like(stored.host, device=stored.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._timed_copy(tensor, stored.host, nbytes)
            done = torch.cuda.Event()
            done.record(self.stream)
        # No record_stream here: the backward waits on each copy before it uses the tensor (an input before its
        # layer's recomputation, a kept attention output at the attention call replaying it; one left unused by
        # a backward that raised is freed only when the next forward replaces it, seconds later), and
        # record_stream would hold every block until all later prefetches are done, raising the peak.
        return PendingTensor(tensor, done, self)

    def wait_on_current_stream(self, event: torch.cuda.Event) -> None:
        compute = torch.cuda.current_stream(self.device)
        if not self.timed:
            compute.wait_event(event)
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(event)
        after.record(compute)
        self.stats.stalls.append((before, after))

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        if not self.timed:
            dst.copy_(src, non_blocking=True)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        dst.copy_(src, non_blocking=True)
        end.record(self.stream)
        self.stats.timings.append((start, end, nbytes))

    def take_stats(self) -> dict[str, float]:
        """Copy volume, speed and how much of it was hidden behind compute since the last call."""
        stats, self.stats = self.stats, CopyStats()
        result = {"offload/pinned_gib": self.pool.nbytes / GIB,
                  "offload/d2h_gib": stats.d2h_bytes / GIB, "offload/h2d_gib": stats.h2d_bytes / GIB}
        if not stats.timings:
            return result
        torch.cuda.synchronize(self.device)
        copy_s = sum(start.elapsed_time(end) for start, end, _ in stats.timings) / 1e3
        stall_s = sum(before.elapsed_time(after) for before, after in stats.stalls) / 1e3
        moved = sum(n for _, _, n in stats.timings)
        result.update({"offload/copy_gb_per_s": moved / max(copy_s, 1e-9) / 1e9,
                       "offload/copy_s": copy_s, "offload/exposed_s": stall_s,
                       "offload/hidden_fraction": 1.0 - min(stall_s, copy_s) / max(copy_s, 1e-9)})
        return result
