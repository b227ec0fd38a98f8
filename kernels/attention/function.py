"""Our attention as one autograd function: the forward and the backward its route names (kernels/attention/
route.py: the Gluon or the Triton forward, the one-pass Gluon or the two-kernel Triton backward), packed
documents, the attention tape and the tuning of long sequences on a prefix.

With `cu_seqlens` (int32 document offsets over the flattened B*S token axis) the batch is folded into one
row of B*S tokens, and each token's document bounds are handed to the kernels. Under a recording
`attention_tape.AttentionTape` the forward also hands (out, lse) to the tape; under a replaying one it
returns the taped output without running a forward kernel (checkpointing).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.utils.weak import WeakIdKeyDictionary

from conf.capability import triton_interpreting
import kernels.attention.attention_tape as attention_tape
import kernels.attention.flash_attention as flash_attention
import kernels.attention.flash_attention_hopper as flash_attention_hopper
import kernels.attention.flash_attention_hopper_backward as flash_attention_hopper_backward
from kernels.attention.flash_attention import LOG2E, TUNE_MAX_SEQLEN
from kernels.reference import check_cu_seqlens


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, cu_seqlens, softmax_scale, route):
        """route: the call's AttentionRoute (AttentionRoute.for_call), whose forward is "gluon" or "triton" and
        backward "gluon" or "triton"; its methods say what runs for these tensors."""
        flash_attention.check_inputs(q, k, v)
        batch, seqlen = q.shape[:2]
        sm_scale = softmax_scale if softmax_scale is not None else q.shape[3] ** -0.5
        flash_attention.ensure_allocator(q.device)
        doc_start = doc_end = None
        if cu_seqlens is not None:
            doc_start, doc_end = _checked_document_bounds(cu_seqlens, batch, seqlen, q.device)
            q, k, v = _fold_batch(q, "q"), _fold_batch(k, "k"), _fold_batch(v, "v")
        forward = route.forward_runs(q, k, v)
        tuning_key = (q.dtype, q.shape[2:], k.shape[2], causal, cu_seqlens is not None, route.backward)
        # Hopper's Gluon forward and one-pass backward tune nothing: no prefix run for them.
        if not (forward == route.backward == "gluon") and _needs_prefix_tuning(q.shape[1], tuning_key):
            _tune_on_prefix(route, q, k, v, doc_start, doc_end, causal, sm_scale, tuning_key)
        saved = attention_tape.replayed(q)      # a checkpoint's recomputation: the first forward's result
        if saved is None:
            out, lse = _forward(forward, q, k, v, doc_start, doc_end, causal, sm_scale)
            attention_tape.record(out, lse)
        else:
            out, lse = saved
        ctx.save_for_backward(q, k, v, out, lse, doc_start, doc_end)
        ctx.causal, ctx.sm_scale, ctx.batch_shape, ctx.route = causal, sm_scale, (batch, seqlen), route
        return out.view(batch, seqlen, *out.shape[2:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, doc_start, doc_end = ctx.saved_tensors
        flash_attention.ensure_allocator(q.device)
        # Packed documents fold the batch; reshape is a view for any gradient the model produces.
        grad_out = grad_out.reshape(out.shape)
        dq, dk, dv = _backward(ctx.route, grad_out, q, k, v, out, lse, doc_start, doc_end, ctx.causal, ctx.sm_scale)
        batch, seqlen = ctx.batch_shape
        return (dq.view(batch, seqlen, *dq.shape[2:]), dk.view(batch, seqlen, *dk.shape[2:]),
                dv.view(batch, seqlen, *dv.shape[2:]), None, None, None, None)


def _forward(forward: str, q, k, v, doc_start, doc_end, causal: bool, sm_scale: float):
    """(out, lse in base 2) by the Gluon ("gluon") or the Triton ("triton") forward."""
    if forward == "gluon":
        return flash_attention_hopper.attention_forward(q, k, v, doc_start, doc_end, causal, sm_scale * LOG2E)
    return flash_attention.forward(q, k, v, doc_start, doc_end, causal, sm_scale)


def _backward(route, do, q, k, v, out, lse, doc_start, doc_end, causal: bool, sm_scale: float):
    """(dq, dk, dv) by the backward the route runs for this dO (AttentionRoute.backward_runs)."""
    delta = flash_attention.row_deltas(out, do, lse)
    if route.backward_runs(q, do) == "gluon":
        return flash_attention_hopper_backward.attention_backward(do, q, k, v, lse, delta, doc_start, doc_end,
                                                                  causal, sm_scale, sm_scale * LOG2E)
    return flash_attention.backward(do, q, k, v, lse, delta, doc_start, doc_end, causal, sm_scale)


# The kernel keys tuned on a prefix in this process.
_tuned_on_prefix: set[tuple] = set()


def _needs_prefix_tuning(seqlen: int, key: tuple) -> bool:
    """Whether a call at `seqlen` should first tune on a TUNE_MAX_SEQLEN prefix (once per kernel key)."""
    return seqlen > TUNE_MAX_SEQLEN and key not in _tuned_on_prefix and not triton_interpreting()


def _tune_on_prefix(route, q, k, v, doc_start, doc_end, causal: bool, sm_scale: float, key: tuple) -> None:
    """Run the forward and backward once on the first TUNE_MAX_SEQLEN tokens, so the autotuner picks the
    configs of this key there (seconds) and the long call reuses them. The backward is tuned here too,
    where memory is low, rather than in the first backward, where a long sequence's step peaks."""
    n = TUNE_MAX_SEQLEN
    bounds = (doc_start[:n], doc_end[:n].clamp(max=n)) if doc_start is not None else (None, None)
    q, k, v = q[:, :n], k[:, :n], v[:, :n]
    out, lse = _forward(route.forward_runs(q, k, v), q, k, v, *bounds, causal, sm_scale)
    _backward(route, out, q, k, v, out, lse, *bounds, causal, sm_scale)  # any dO will do: out
    _tuned_on_prefix.add(key)


# Checking cu_seqlens reads it back to the host, which waits for the GPU: once per tensor (again after an
# in-place change by torch ops, which bumps its version; not one through .data, numpy or a collective), not
# in every layer's forward. Each layer of a step gets the same tensor.
_checked_bounds = WeakIdKeyDictionary()


def _checked_document_bounds(cu_seqlens: torch.Tensor, batch: int, seqlen: int,
                             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """document_bounds of a checked cu_seqlens, computed once per tensor and layout (every call for an
    inference-mode tensor, which has no version to tell a change by)."""
    stamp = None if cu_seqlens.is_inference() else (cu_seqlens._version, batch, seqlen, device)
    known = _checked_bounds.get(cu_seqlens)
    if stamp is not None and known is not None and known[0] == stamp:
        return known[1]
    check_cu_seqlens(cu_seqlens, batch, seqlen)
    bounds = document_bounds(cu_seqlens.to(device), batch * seqlen)
    if stamp is not None:
        _checked_bounds[cu_seqlens] = (stamp, bounds)
    return bounds


def document_bounds(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the start and end offsets of its document (int32, O(total) memory): the doc_start and
    doc_end that the attention kernels take."""
    positions = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    doc = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    return cu_seqlens[doc].contiguous(), cu_seqlens[doc + 1].contiguous()


def _fold_batch(t: torch.Tensor, name: str) -> torch.Tensor:
    """[B, S, H, D] -> [1, B*S, H, D] without a copy: documents run across batch rows."""
    batch, seqlen = t.shape[:2]
    if batch > 1 and t.stride(0) != seqlen * t.stride(1):
        raise ValueError(f"with cu_seqlens, {name} must be viewable as [1, B*S, H, D] (batch stride == S * "
                         f"token stride), got strides {tuple(t.stride())}")
    return t.view(1, batch * seqlen, *t.shape[2:]) if batch > 1 else t
