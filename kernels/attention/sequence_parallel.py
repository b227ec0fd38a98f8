"""Ulysses sequence parallelism for attention, over a torch.distributed process group.

Each rank of the group holds a contiguous slice of the sequence: q [B, S/P, Hq, D], k and v
[B, S/P, Hkv, D]. One all-to-all turns them into the whole sequence for a share of the heads
([B, S, Hq/P, D]), attention runs on that (any attention function with the reference's signature, with the
document offsets of the global sequence), and one all-to-all turns its output back into this rank's tokens
for every head. Both all-to-alls are autograd functions whose backward is the inverse exchange.

KV heads fewer than the group (Llama-3 8B: 8 KV heads over 16 ranks) are repeated until there are as many
as ranks, each query head keeping its KV head; autograd sums the repeats' gradients back.

Query heads the degree does not divide (Qwen2.5-7B: 28 over 8 ranks) are padded with zero heads, each KV head's
group of query heads up to a multiple of the ranks that share that KV head (7 to 8: 32 heads), and the padding's
output is dropped after the exchange back. The padding's output has no gradient, so nothing flows back
through its attention. It costs its share of the exchanged bytes and of the attention's work (8/7 for Qwen2.5-7B
over 8 ranks; docs/ARCHITECTURE.md, "Adding a model family", says what was measured).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from conf.schema.parallel import heads_split, padded_query_heads


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x along scatter_dim into one part per rank, send part i to rank i, and concatenate what
    arrives, in rank order, along gather_dim (both dims counted from the front). The parts travel as one
    tensor with the rank first: gloo (CPU ranks) has no list all_to_all in torch 2.11, only the single-tensor
    one. With one batch row, splitting the sequence sends x itself and gathering it returns a view: no copy."""
    parts = x.unflatten(scatter_dim, (dist.get_world_size(group), -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/P, H, D] on each rank -> [B, S, H/P, D]: the whole sequence for this rank's heads."""
    return _AllToAll.apply(x, group, 2, 1)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, H/P, D] -> [B, S/P, H, D]: this rank's tokens for every head (the inverse)."""
    return _AllToAll.apply(x, group, 1, 2)


def check_heads(q_heads: int, kv_heads: int, degree: int) -> None:
    """Ulysses shards heads: the KV heads must either split or repeat evenly into the group (query heads are
    padded to a multiple)."""
    if not heads_split(q_heads, kv_heads, degree):
        raise ValueError(f"sequence parallelism over {degree} ranks needs KV heads ({kv_heads}) dividing or "
                         f"divisible by {degree}")


def pad_query_heads(q: torch.Tensor, kv_heads: int, padded: int) -> torch.Tensor:
    """q [B, S, H, D] with zero heads appended to each KV head's group, `padded` heads in all."""
    batch, seqlen, heads, dim = q.shape
    groups = q.view(batch, seqlen, kv_heads, heads // kv_heads, dim)
    return F.pad(groups, (0, 0, 0, (padded - heads) // kv_heads)).view(batch, seqlen, padded, dim)


def drop_padded_heads(out: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """The inverse of pad_query_heads: out [B, S, padded, D] without its padding heads."""
    batch, seqlen, padded, dim = out.shape
    groups = out.view(batch, seqlen, kv_heads, padded // kv_heads, dim)
    return groups[:, :, :, : heads // kv_heads].reshape(batch, seqlen, heads, dim)


def ulysses_attention(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, **options) -> torch.Tensor:
    """attention(q, k, v, **options) over the whole sequence, each rank holding a slice of its tokens and
    computing a share of its heads; options carry the global sequence's cu_seqlens."""
    degree = dist.get_world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    check_heads(heads, kv_heads, degree)
    padded = padded_query_heads(heads, kv_heads, degree)
    if padded != heads:
        q = pad_query_heads(q, kv_heads, padded)
    if kv_heads < degree:
        repeats = degree // kv_heads
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    out = attention(heads_to_sequence(q, group), heads_to_sequence(k, group), heads_to_sequence(v, group),
                    **options)
    out = sequence_to_heads(out, group)
    return out if padded == heads else drop_padded_heads(out, kv_heads, heads)
