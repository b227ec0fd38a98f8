"""Plain PyTorch versions of every op the model uses.

These are the contract: the Triton kernels in this package must match them, the tests use them as the
oracle, and machines without CUDA run them. Math is done in fp32 and results are cast back to the input
dtype, so a bf16 model on CPU still gets fp32-accurate ops.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Standard LayerNorm over the last dimension with fp32 statistics."""
    x32 = x.float()
    mean = x32.mean(dim=-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (x32 - mean) * torch.rsqrt(var + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q [B, S, Hq, D] and k [B, S, Hkv, D] by per-token tables cos, sin
    [B, S, 1, D] (`model.rope.rope_tables`: packed documents' restarting positions, the rope scaling and its
    attention factor are already in them), in the rotate-half convention of transformers' Llama:
    x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). Returns new (q, k)
    in their own dtypes."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        first, second = x32.chunk(2, dim=-1)
        return (x32 * cos.float() + torch.cat((-second, first), dim=-1) * sin.float()).to(x.dtype)
    return rotate(q), rotate(k)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of Llama's MLP: silu(gate) * up, elementwise, in gate's dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Map each of `total` token positions to the index of the document that holds it."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> None:
    """Validate FlashAttention-style document offsets over the flattened batch*seqlen token axis."""
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor of document offsets with at least 2 entries, got "
            f"dtype={cu_seqlens.dtype} shape={tuple(cu_seqlens.shape)}")
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != batch * seqlen:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at batch*seqlen={batch * seqlen}, got {first}..{last}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def _attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      softmax_scale: float | None) -> tuple[float, int]:
    """(softmax scale, query heads per KV head) of attention's inputs, or a ValueError naming the shapes."""
    q_heads, head_dim, kv_heads = q.shape[2], q.shape[3], k.shape[2]
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})")
    return (softmax_scale if softmax_scale is not None else head_dim ** -0.5), q_heads // kv_heads


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              cu_seqlens: torch.Tensor | None = None, softmax_scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads and packed documents.

    q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] with Hq a multiple of Hkv (query head h reads KV head
    h // (Hq // Hkv)). cu_seqlens: int32 offsets of documents over the flattened B*S token axis (as in
    FlashAttention's varlen API); a token attends only to tokens of its own document. Returns [B, S, Hq, D].
    """
    batch, seqlen, q_heads, head_dim = q.shape
    scale, group = _attention_shapes(q, k, v, softmax_scale)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch, seqlen)
        # Documents index the flattened token axis: fold the batch into one long row.
        q, k, v = (t.reshape(1, batch * seqlen, *t.shape[2:]) for t in (q, k, v))
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))             # [b, heads, s, D]
    mask = None
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, qf.shape[2])
        mask = doc[:, None] == doc[None, :]
        if causal:
            mask = mask.tril()
    # PyTorch's fused attention in fp32: exact softmax attention without an S x S tensor when unmasked.
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=causal and mask is None,
                                         scale=scale, enable_gqa=group > 1).transpose(1, 2)
    return out.reshape(batch, seqlen, q_heads, head_dim).to(q.dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of softmax(hidden @ weight.T) against targets, in fp32.

    hidden: [N, H]; weight: [V, H]; targets: [N]. "mean" averages over the tokens whose target is not
    ignore_index and is 0 (not NaN) when every target is ignored; "sum" adds them.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    logits = hidden.float() @ weight.float().t()
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum().clamp(min=1)


def round_stochastically(x: torch.Tensor, dtype: torch.dtype, seed: int, first: int = 0) -> torch.Tensor:
    """fp32 `x` in `dtype`: bf16 is rounded up or down at random with probability proportional to the
    distance (E[result] = x), so increments far below bf16's resolution still add up in expectation;
    any other dtype is rounded to nearest. Non-finite values pass unchanged. `x` may be the elements from
    flat index `first` of a larger tensor (a rank's shard): each element draws the noise it draws there."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    generator = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.randint(0, 1 << 16, (first + x.numel(),), dtype=torch.int32, device=x.device,
                          generator=generator)[first:].view(x.shape)
    # Adding noise to the 16 bits bf16 drops, then truncating them, rounds the magnitude up with
    # probability (dropped bits) / 2^16 whatever the sign.
    truncated = ((x.view(torch.int32) + noise) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(x), truncated, x).to(dtype)


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 grad_scale: float = 1.0, seed: int = 0, first: int = 0) -> None:
    """One AdamW step in place, as torch.optim.AdamW (decoupled weight decay, bias correction), on
    `grad * grad_scale` (the clipping coefficient). Math in fp32; bf16 param and moments are stored with
    stochastic rounding (`round_stochastically`, one seed per tensor derived from `seed`). The tensors may be a
    shard, from flat index `first` of the whole parameter: its elements round as the whole tensor's would."""
    g = grad.float() * grad_scale
    m = exp_avg.float().lerp_(g, 1 - beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    p = param.float().mul_(1 - lr * weight_decay).addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
    for index, (stored, value) in enumerate(((param, p), (exp_avg, m), (exp_avg_sq, v))):
        stored.copy_(round_stochastically(value, stored.dtype, seed * 3 + index, first))


# FP8 (model/fp8.py): e4m3 with one fp32 scale per row. Values are divided by their row's scale so that the
# row's largest magnitude lands on e4m3's largest finite value; the scale is what dequantizes them again.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# A row of zeros gets this amax (any positive scale dequantizes zeros to zeros) rather than a division by 0. Far
# below any real row's: a long sequence's gradients, times the weight's row scales folded into them
# (model/fp8.py), can have row maxima near 1e-12, and a larger floor would coarsen them.
FP8_MIN_AMAX = 2.0 ** -100


def quantize_rows(x: torch.Tensor, column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (times `column_scale` [K] per column, fp32, when given) as e4m3 [M, K] and its fp32 row
    scales [M]: dequantized = q.float() * scale[:, None]. Rounding to nearest. A row holding a non-finite value
    gets a NaN scale (and here NaN values; e4m3 has no infinity, and a cast would saturate it to 448): its
    dequantized values and every product of the row are NaN, so a bad value is never hidden. The Triton kernel
    gives the same scale; the values it stores for such a row are not part of the contract."""
    x32 = x.float() if column_scale is None else x.float() * column_scale.float()
    amax = x32.abs().amax(dim=-1).clamp(min=FP8_MIN_AMAX)
    # Divided by a tensor: PyTorch divides a CUDA tensor by a scalar as a product with its reciprocal, which is
    # not the IEEE quotient that the kernel computes (and the CPU gives)
    scale = torch.where(torch.isfinite(x32).all(dim=-1), amax / torch.full_like(amax, FP8_MAX), torch.nan)
    q = (x32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


def transpose(x: torch.Tensor) -> torch.Tensor:
    """x [R, C] as a new contiguous [C, R] tensor."""
    return x.t().contiguous()


def scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """The product of two row-quantized e4m3 operands over their last dimension: a [M, K] with row scales
    [M], b [N, K] with row scales [N]; out[m, n] = a_scale[m] * b_scale[n] * sum_k a[m, k] * b[n, k], in fp32,
    then `out_dtype` (autocast off: under it the product would run in its lower dtype)."""
    with torch.autocast(a.device.type, enabled=False):
        return ((a.float() @ b.float().t()) * a_scale.float()[:, None] * b_scale.float()[None, :]).to(out_dtype)


# FP8 attention (issue 48): the contract of a flash-style forward whose two products, Q·Kᵀ and P·V, run in e4m3.
# P = exp(S - rowmax) lies in [0, 1]; it is stored times this fixed power of two, the largest not above FP8_MAX:
# P = 1 lands on 256 exactly, values down to 2^-14 keep e4m3's full precision (they flush to 0 below 2^-18; at
# scale 1, FlashAttention-3's, below 2^-10), and the kernel folds 1/256 into the row sum exactly.
FP8_P_SCALE = 256.0
LOG2E = math.log2(math.e)


def quantize_token_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, H, D] as e4m3 [B, T, H, D] with one fp32 scale per (batch, head, block of `block` tokens)
    [B, H, ceil(T / block)]: dequantized = values.float() * scale of the token's block. Blocks start at token 0
    (packed documents share the blocks that straddle their boundaries). The scale is quantize_rows' (amax / 448,
    FP8_MIN_AMAX for an all-zero block, whose values stay zeros; NaN for a block holding a non-finite value, whose
    values are NaN here and not part of the contract)."""
    batch, tokens, heads, head_dim = x.shape
    blocks = -(-tokens // block)
    padded = F.pad(x.float(), (0, 0, 0, 0, 0, blocks * block - tokens))          # zero tokens: no effect on amax
    rows = padded.reshape(batch, blocks, block, heads, head_dim).permute(0, 3, 1, 2, 4)
    values, scale = quantize_rows(rows.reshape(batch * heads * blocks, block * head_dim))
    values = values.reshape(batch, heads, blocks, block, head_dim).permute(0, 2, 3, 1, 4)
    return values.reshape(batch, blocks * block, heads, head_dim)[:, :tokens], scale.reshape(batch, heads, blocks)


def hadamard_rotation(head_dim: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthogonal [D, D] fp32 matrix diag(random signs) · H_D / sqrt(D) (H_D: Sylvester's Hadamard matrix, D a
    power of two; signs from `seed`): q R (k R)ᵀ = q kᵀ, while a few large channels of q and k spread over all D
    (FlashAttention-3's incoherent processing), which lowers e4m3's error on their products."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"the Hadamard rotation needs head_dim a power of two, got {head_dim}")
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < head_dim:
        hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)), 0)
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=generator, dtype=torch.float64) * 2 - 1
    return (signs[:, None] * hadamard * head_dim ** -0.5).to(device=device, dtype=torch.float32)


def _straight_through(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [B, T, H, D] fp32 dequantized from its e4m3 blocks (NaN in a non-finite block), with the identity as the
    gradient."""
    values, scale = quantize_token_blocks(x, block)
    token_scale = scale.repeat_interleave(block, dim=2)[:, :, :x.shape[1]].transpose(1, 2)
    return x + (values.float() * token_scale[..., None] - x).detach()


def _visible_keys(first: int, end: int, causal: bool, doc: torch.Tensor | None, tokens: int,
                  device: torch.device) -> tuple[int, int, torch.Tensor | None]:
    """The key range [lo, hi) that queries [first, end) may see (their documents', up to the last query when
    causal), and which pairs in it attend ([end - first, hi - lo], None when all do)."""
    lo, hi = 0, tokens
    if doc is not None:
        lo = int(torch.searchsorted(doc, doc[first], right=False))
        hi = int(torch.searchsorted(doc, doc[end - 1], right=True))
    if causal:
        hi = min(hi, end)
    queries = torch.arange(first, end, device=device)[:, None]
    keys = torch.arange(lo, hi, device=device)[None, :]
    visible = None
    if causal:
        visible = keys <= queries
    if doc is not None:
        same = doc[first:end, None] == doc[None, lo:hi]
        visible = same if visible is None else visible & same
    return lo, hi, visible


def _fp8_query_block(q, k, v, v_bad, visible, softmax_scale: float):
    """One block of queries against its keys, as the kernel computes it: q [b, Hq, M, D], k and v [b, Hq, N, D]
    dequantized (each KV head repeated for its query heads), v_bad [b, Hq, N]. Returns out [b, Hq, M, D] and
    lse [b, Hq, M] (natural log), fp32."""
    scores = (q @ k.transpose(-1, -2)) * softmax_scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    p_fp8 = (p * FP8_P_SCALE).to(FP8_DTYPE).float() / FP8_P_SCALE
    p_fp8 = p + (p_fp8 - p).detach()
    out = (p_fp8 @ v.masked_fill(v_bad[..., None], 0.0)) / row_sum
    seen = v_bad[:, :, None, :] if visible is None else v_bad[:, :, None, :] & visible
    out = out.masked_fill(seen.any(dim=-1, keepdim=True), float("nan"))
    return out, (row_max + row_sum.log()).squeeze(-1)


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  cu_seqlens: torch.Tensor | None = None, softmax_scale: float | None = None, *,
                  block_m: int = 128, block_n: int = 128, rotate: bool = False, seed: int = 0,
                  return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention` (same layouts, GQA, packed documents) as an FP8 flash forward computes it:

    - q in e4m3 per (batch, head, block of `block_m` tokens), k and v per (batch, KV head, block of `block_n`
      tokens): `quantize_token_blocks`; blocks run over the flattened B*S axis when cu_seqlens is given.
      With `rotate`, q and k are first multiplied by `hadamard_rotation(D, seed)` (in fp32). A kernel applies
      q's and k's scales to the rows and columns of S, whatever its tiles; v's scale changes along P·V's sum,
      so its key tiles must follow the blocks (our Hopper forward starts them at a document's first token).
    - S = the fp32 product of the dequantized q and k (the kernel's e4m3 product, accumulated in fp32, times
      the two scales: equal up to fp32 rounding), times softmax_scale; pairs that do not attend are -inf.
    - m = the row's exact max of S over all its keys (a kernel's running max differs in the P values it rounds,
      not in their precision), P = exp(S - m), l = the row sum of P in fp32 before its cast.
    - P in e4m3 as round(P * FP8_P_SCALE) / FP8_P_SCALE; out = (P_fp8 · v dequantized) / l, in q's dtype.
    - lse (return_lse: out, lse) = m + log l in base 2 of the scaled logits, [B, Hq, S] fp32, as the flash
      kernels' forward returns it for their backward.

    A scale looks at its whole block, so a query's result depends (through its block's amax only) on later
    tokens of its own blocks; nothing else crosses a block, a document or the causal mask. Non-finite inputs:
    a row's output is NaN exactly when its query block, or a key or value block holding one of the keys it
    sees, has a non-finite value; every other row is as without them.

    Backward (what issue 48 tests an FP8 backward against): autograd through this function treats each cast as
    the identity (straight-through; scales and m are constants), the target of a backward in FP8; the
    alternative, the bf16 backward from the kept statistics, is `attention_backward(q, k, v, out, lse, ...)`.
    Query blocks run one at a time (checkpointed under autograd), so memory stays O(S·block) per head.
    """
    batch, seqlen, q_heads, head_dim = q.shape
    scale, group = _attention_shapes(q, k, v, softmax_scale)
    doc = None
    qf, kf, vf = q.float(), k.float(), v.float()
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch, seqlen)
        qf, kf, vf = (t.reshape(1, batch * seqlen, *t.shape[2:]) for t in (qf, kf, vf))
        doc = document_ids(cu_seqlens, batch * seqlen)
    if rotate:
        rotation = hadamard_rotation(head_dim, seed, q.device)
        qf, kf = qf @ rotation, kf @ rotation
    qf, kf, vf = _straight_through(qf, block_m), _straight_through(kf, block_n), _straight_through(vf, block_n)
    # A non-finite query or key block makes the scores it enters NaN; a value block's must reach only the rows
    # that see one of its keys, so the product takes it as zeros and the rows are marked NaN after it.
    v_bad = vf.isnan().any(dim=-1)
    qf = qf.transpose(1, 2)                                                   # [b, heads, tokens, D]
    kf, vf, v_bad = (t.transpose(1, 2).repeat_interleave(group, dim=1) for t in (kf, vf, v_bad))
    tokens = qf.shape[2]
    outs, lses = [], []
    for first in range(0, tokens, block_m):
        end = min(first + block_m, tokens)
        lo, hi, visible = _visible_keys(first, end, causal, doc, tokens, q.device)
        inputs = (qf[:, :, first:end], kf[:, :, lo:hi], vf[:, :, lo:hi], v_bad[:, :, lo:hi], visible, scale)
        if torch.is_grad_enabled():
            out, lse = checkpoint(_fp8_query_block, *inputs, use_reentrant=False)
        else:
            out, lse = _fp8_query_block(*inputs)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=2).transpose(1, 2).reshape(batch, seqlen, q_heads, head_dim).to(q.dtype)
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=2) * LOG2E
    return out, (lse.reshape(q_heads, batch, seqlen).transpose(0, 1) if cu_seqlens is not None else lse)


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       dout: torch.Tensor, causal: bool = True, cu_seqlens: torch.Tensor | None = None,
                       softmax_scale: float | None = None, *,
                       block_m: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `attention` from a forward's kept statistics, as the flash backwards compute them: P is
    recomputed from q and k with the given lse (base 2, [B, Hq, S], as `fp8_attention(..., return_lse=True)` and
    the flash forwards return it), delta = rowsum(dout * out), dS = P (dout vᵀ - delta). Given the exact
    forward's out and lse these are attention's gradients; given the FP8 forward's, they are what a bf16 backward
    after an FP8 forward computes. Math in fp32, results in the inputs' dtypes."""
    batch, seqlen, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    scale, group = _attention_shapes(q, k, v, softmax_scale)
    doc = None
    tensors = [t.float() for t in (q, k, v, out, dout)]
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch, seqlen)
        tensors = [t.reshape(1, batch * seqlen, *t.shape[2:]) for t in tensors]
        lse = lse.transpose(0, 1).reshape(1, q_heads, batch * seqlen)
        doc = document_ids(cu_seqlens, batch * seqlen)
    qf, kf, vf, of, dof = (t.transpose(1, 2) for t in tensors)                # [b, heads, tokens, D]
    kf, vf = (t.repeat_interleave(group, dim=1) for t in (kf, vf))
    lse_natural = lse.float() / LOG2E
    delta = (dof * of).sum(dim=-1)
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    tokens = qf.shape[2]
    for first in range(0, tokens, block_m):
        end = min(first + block_m, tokens)
        lo, hi, visible = _visible_keys(first, end, causal, doc, tokens, q.device)
        scores = (qf[:, :, first:end] @ kf[:, :, lo:hi].transpose(-1, -2)) * scale
        p = torch.exp(scores - lse_natural[:, :, first:end, None])
        if visible is not None:
            p = p.masked_fill(~visible, 0.0)
        dp = dof[:, :, first:end] @ vf[:, :, lo:hi].transpose(-1, -2)
        ds = p * (dp - delta[:, :, first:end, None]) * scale
        dv[:, :, lo:hi] += p.transpose(-1, -2) @ dof[:, :, first:end]
        dk[:, :, lo:hi] += ds.transpose(-1, -2) @ qf[:, :, first:end]
        dq[:, :, first:end] = ds @ kf[:, :, lo:hi]
    # Each KV head's gradient is the sum over the query heads that read it.
    dk, dv = (t.reshape(t.shape[0], kv_heads, group, *t.shape[2:]).sum(dim=2) for t in (dk, dv))
    return tuple(t.transpose(1, 2).reshape(source.shape).to(source.dtype)
                 for t, source in ((dq, q), (dk, k), (dv, v)))
