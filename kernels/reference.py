"""Plain PyTorch versions of every op the model uses.

These are the contract: the Triton kernels in this package must match them, the tests use them as the
oracle, and machines without CUDA run them. Math is done in fp32 and results are cast back to the input
dtype, so a bf16 model on CPU still gets fp32-accurate ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              cu_seqlens: torch.Tensor | None = None, softmax_scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads and packed documents.

    q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] with Hq a multiple of Hkv (query head h reads KV head
    h // (Hq // Hkv)). cu_seqlens: int32 offsets of documents over the flattened B*S token axis (as in
    FlashAttention's varlen API); a token attends only to tokens of its own document. Returns [B, S, Hq, D].
    """
    batch, seqlen, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})")
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    group = q_heads // kv_heads
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
