"""Attention with cuDNN's fused backward (PyTorch's aten ops), on Hopper GPUs.

On the H100 cuDNN's backward is faster than our Triton two-kernel one (docs/PERFORMANCE.md), so
`kernels=auto` plans for it there (kernels/attention/route.py) and runs it for rows without packed documents.
The forward is our warp-specialized Gluon kernel (kernels/attention/flash_attention_hopper.py, faster than
cuDNN's own: docs/PERFORMANCE.md) where the route finds that it reads the inputs, with its log-sum-exp turned
into cuDNN's statistics (natural log, [B, H, S, 1]); cuDNN's forward otherwise. Same contract as
`kernels.reference.attention` (q [B, S, Hq, D], k and v [B, S, Hkv, D], GQA without repeating K/V) and the
same attention-tape protocol as our kernels: the forward records (out, lse); under a replaying tape the
recomputation returns the recorded output and runs no forward kernel.

The aten ops take [B, H, S, D] views of our [B, S, H, D] tensors (transposes, no copies) and return the
output laid out [B, S, H, D] in memory; dO must have the output's strides. Their backward adds dQ with
atomics (not bit-identical run to run; `deterministic=true` runs our Triton backward instead) and needs a
workspace of about two fp32 copies of dQ (`backward_workspace_bytes`, which the planner counts). Past
MAX_WORKSPACE_BYTES (131k tokens of 32 heads of 128) the backward runs over groups of KV heads, each with its
query heads: a KV head's gradients come only from its own query heads, so each group's dQ, dK and dV are
final, and at 524k tokens the 16 GiB workspace of one call becomes 4 GiB per group.

Rows of packed documents stay on our kernels: torch 2.11's cuDNN ops for them (`_cudnn_attention_forward/
backward` with cum_seq_q), tried with Llama-3's 32 query / 8 KV heads, ran the forward far slower than ours
and returned wrong gradients (docs/PERFORMANCE.md).
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

import kernels.attention.attention_tape as attention_tape
from kernels.attention.attention_workspace import fewest_head_groups

LN2 = math.log(2)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Measured peak memory of the aten backward beyond its inputs and dq/dk/dv, per query element (token x
# query head x head dim): 1.00 GiB at 32k tokens and 4.02 GiB at 131k with 32 heads of 128.
WORKSPACE_BYTES_PER_QUERY_ELEMENT = 8
# One backward call's workspace at most: 131k tokens of 32 heads of 128 (measured there: one call).
MAX_WORKSPACE_BYTES = 4 * 2**30


def supports(q: torch.Tensor, k: torch.Tensor, cu_seqlens) -> bool:
    """Whether these inputs take the cuDNN path: unpacked rows of a supported dtype and head dim."""
    return (cu_seqlens is None and q.dtype in SUPPORTED_DTYPES and k.dtype == q.dtype
            and q.shape[-1] in SUPPORTED_HEAD_DIMS and q.stride(-1) == 1 and k.stride(-1) == 1)


def _one_call_workspace_bytes(tokens: int, q_heads: int, head_dim: int) -> int:
    return WORKSPACE_BYTES_PER_QUERY_ELEMENT * tokens * q_heads * head_dim


def backward_head_groups(tokens: int, q_heads: int, kv_heads: int, head_dim: int) -> int:
    """How many groups of KV heads the backward runs over: the fewest that divide the KV heads and keep one
    call's workspace within MAX_WORKSPACE_BYTES (one group per KV head at most)."""
    return fewest_head_groups(_one_call_workspace_bytes(tokens, q_heads, head_dim), kv_heads, MAX_WORKSPACE_BYTES)


def backward_workspace_bytes(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """The backward's memory beyond its inputs and the gradients it returns: one call's workspace and, over
    several head groups, the group's gradients before they are copied into the whole ones."""
    groups = backward_head_groups(tokens, q_heads, kv_heads, head_dim)
    workspace = _one_call_workspace_bytes(tokens, q_heads, head_dim) // groups
    if groups == 1:
        return workspace
    return workspace + tokens * (q_heads + 2 * kv_heads) // groups * head_dim * dtype_bytes


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


class CudnnAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale, route):
        """route: the call's AttentionRoute (kernels/attention/route.py), which says which forward runs."""
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        saved = attention_tape.replayed(q)      # a checkpoint's recomputation: the first forward's result
        if saved is None:
            out, lse = _forward(q, k, v, causal, scale, route.forward_runs(q, k, v))
            attention_tape.record(out, lse)
        else:
            out, lse = saved
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out.stride() != out.stride():
            # cuDNN reads dO with O's strides. The model's dO (o_proj's input gradient) has them; a broadcast
            # one (stride 0, from out.sum()) or another layout is copied into O's: the only copy this op makes.
            grad_out = torch.empty_like(out).copy_(grad_out)
        batch, seqlen, q_heads, head_dim = q.shape
        groups = backward_head_groups(batch * seqlen, q_heads, k.shape[2], head_dim)
        if groups == 1:
            return (*_backward(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale), None, None, None)
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for group in range(groups):
            queries, keys = _group_heads(group, groups, q_heads), _group_heads(group, groups, k.shape[2])
            _backward_group_into(grads, queries, keys, grad_out, q, k, v, out, lse, ctx.causal, ctx.scale)
        return (*grads, None, None, None)


def _forward(q, k, v, causal: bool, scale: float, forward: str):
    """(out [B, S, H, D], cuDNN's softmax statistics [B, H, S, 1]) for cuDNN's backward, by the Gluon kernel
    (forward="gluon") or cuDNN's own ("cudnn")."""
    if forward == "gluon":
        # Imported here, not with this module: importing Triton fixes its choice of interpreter or compiler for
        # the process, which importing the model (and so this module) must leave to the caller.
        import kernels.attention.flash_attention as flash_attention
        import kernels.attention.flash_attention_hopper as flash_attention_hopper
        flash_attention.check_shapes(q, k, v)     # the kernel reads K/V heads as Hq // Hkv: refuse what it cannot
        flash_attention.ensure_allocator(q.device)
        out, lse_log2 = flash_attention_hopper.attention_forward(q, k, v, None, None, causal,
                                                                 scale * flash_attention.LOG2E)
        return out, lse_log2.mul_(LN2).unsqueeze(-1)
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), None, True, 0.0, causal, False, scale=scale)
    return _heads_first(result[0]), result[1]


def _backward_group_into(grads, queries: slice, keys: slice, grad_out, q, k, v, out, lse, causal: bool,
                         scale: float) -> None:
    """One group's backward, copied into the whole gradients. A function of its own so that the group's
    gradients are freed on return, before the next group's call: the planner counts one group's."""
    # the statistics of these heads: [B, H, S] sliced on H, contiguous for one row (a copy of B x S x H/groups
    # floats otherwise)
    group_grads = _backward(grad_out[:, :, queries], q[:, :, queries], k[:, :, keys], v[:, :, keys],
                            out[:, :, queries], lse[:, queries].contiguous(), causal, scale)
    for whole, part, heads in zip(grads, group_grads, (queries, keys, keys)):
        whole[:, :, heads].copy_(part)


def _group_heads(group: int, groups: int, heads: int) -> slice:
    """The heads of one group: consecutive, as GQA pairs query head h with KV head h // (Hq / Hkv)."""
    size = heads // groups
    return slice(group * size, (group + 1) * size)


def _backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """dQ, dK, dV ([B, S, H, D] views) from one cuDNN backward call."""
    seqlen = q.shape[1]
    no_dropout_state = torch.empty((), dtype=torch.int64, device=q.device)   # philox seed and offset
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _heads_first(grad_out), _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(out), lse,
        no_dropout_state, no_dropout_state, None, None, None, seqlen, seqlen, 0.0, causal, scale=scale)
    return tuple(_heads_first(grad) for grad in grads)


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route, *, causal: bool = True,
                    softmax_scale: float | None = None) -> torch.Tensor:
    """Attention with the signature and layout of `kernels.reference.attention`, without cu_seqlens, on a route
    whose backward is cuDNN's (kernels/attention/route.py; its forward_runs says which forward runs)."""
    return CudnnAttentionFunction.apply(q, k, v, causal, softmax_scale, route)
