"""Reuse of attention outputs between a forward and its recomputation (checkpointing).

A checkpointed layer runs its forward twice: once without grad, once in the backward to rebuild what
autograd needs. The attention is by far the costliest part of that second forward at long sequences
(docs/PERFORMANCE.md), and its result is already known: the first forward's output and per-row
log-sum-exp are all the attention backward needs besides q, k, v. A memory policy records them:

    tape = AttentionTape()
    with tape.recording():
        y = layer(x)                     # each attention call appends (out, lse) to tape.saved
    ...                                  # the policy may move tape.saved to host memory and back
    with tape.replaying():
        y = layer(x)                     # each attention call returns its saved out, no forward kernel

A replayed entry may be a zero-argument callable instead of a tensor (a copy back to the device still in
flight): the replay calls it when the attention reaches it, so the copy overlaps the layer's work before its
attention (norm, projections, RoPE) instead of holding up the whole recomputation.

Our attention (kernels/attention/function.py) and cuDNN's (kernels/attention/cudnn_attention.py) take part; the
reference attention computes as usual, leaving the tape empty, which the policy treats as nothing kept.
The model code knows nothing of this.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionTape:
    """The (out, lse) pairs of one block's attention calls, in call order (to replay: tensors, or callables
    giving them when the call comes)."""
    saved: list[tuple[torch.Tensor | Callable[[], torch.Tensor], ...]] = field(default_factory=list)

    @contextlib.contextmanager
    def recording(self):
        self.saved.clear()
        with _active(self, replay=False):
            yield self

    @contextlib.contextmanager
    def replaying(self):
        with _active(self, replay=True) as use:
            yield self
        if use.cursor != len(self.saved):     # on a clean exit only: never mask the body's own error
            raise RuntimeError(f"attention tape replayed {use.cursor} of its {len(self.saved)} recorded call(s): "
                               "the recomputation makes fewer attention calls than the recorded forward did")


@dataclass
class _Use:
    tape: AttentionTape
    replay: bool
    cursor: int = 0


class _ThreadState(threading.local):
    # Per thread, like grad mode and autocast: autograd runs a CUDA backward (the replay) on its own
    # thread, and a tape must neither take nor answer the attention calls of another thread.
    current: _Use | None = None


_state = _ThreadState()


@contextlib.contextmanager
def _active(tape: AttentionTape, replay: bool):
    outer, _state.current = _state.current, _Use(tape, replay)
    try:
        yield _state.current
    finally:
        _state.current = outer


def record(out: torch.Tensor, lse: torch.Tensor) -> None:
    """Called by the attention after computing: keeps (out, lse) when a tape is recording."""
    use = _state.current
    if use is not None and not use.replay:
        use.tape.saved.append((out, lse))


def replayed(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Called by the attention before computing: the saved (out, lse) for this call when a tape is
    replaying, checked against `like` (the query, whose shape and dtype the output has)."""
    use = _state.current
    if use is None or not use.replay:
        return None
    if use.cursor >= len(use.tape.saved):
        raise RuntimeError(f"attention tape replayed past its {len(use.tape.saved)} recorded call(s): the "
                           "recomputation makes more attention calls than the recorded forward did")
    out, lse = (part() if callable(part) else part for part in use.tape.saved[use.cursor])
    use.cursor += 1
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise RuntimeError(f"attention tape entry {use.cursor - 1} holds a {tuple(out.shape)} {out.dtype} output "
                           f"on {out.device}, but the call's query is {tuple(like.shape)} {like.dtype} on "
                           f"{like.device}: the recomputation differs from the recorded forward")
    return out, lse
