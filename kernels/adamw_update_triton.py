"""Fused AdamW update in Triton, the GPU twin of `reference.adamw_update`.

One pass reads param, gradient and both moments and writes param and moments: 14 bytes per element with
bf16 param/moments and a bf16 gradient, where torch's foreach AdamW makes several passes. Math is fp32;
a bf16 param or moment is stored with stochastic rounding (random bits from Philox, one 32-bit draw per
element split between the three tensors), so without an fp32 master copy an update smaller than half a
bf16 ulp still moves the weight in expectation instead of being rounded away.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _store_rounded(ptr, offsets, mask, value, noise):
    """Store fp32 `value`; into bf16 with stochastic rounding (16 random bits in `noise`)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.int32, bitcast=True)
        truncated = ((bits + (noise & 0xFFFF)) & -65536).to(tl.float32, bitcast=True)
        finite = tl.abs(value) < float("inf")
        value = tl.where(finite, truncated, value)
    tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, n_elements, grad_scale, beta1, beta2, eps,
                  decay_factor, step_size, bias_correction2_sqrt, seed, first, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * grad_scale
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)              # torch's lerp
    exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param * decay_factor - step_size * tl.div_rn(exp_avg, denom)
    # Drawn by the element's index in the whole parameter (a shard starts at `first`): sharding-independent.
    noise_param, noise_avg, noise_sq, _ = tl.randint4x(seed, offsets + first)
    _store_rounded(param_ptr, offsets, mask, param, noise_param.to(tl.int32, bitcast=True))
    _store_rounded(exp_avg_ptr, offsets, mask, exp_avg, noise_avg.to(tl.int32, bitcast=True))
    _store_rounded(exp_avg_sq_ptr, offsets, mask, exp_avg_sq, noise_sq.to(tl.int32, bitcast=True))


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 grad_scale: float = 1.0, seed: int = 0, first: int = 0) -> None:
    """In place; same contract as `kernels.reference.adamw_update` (bf16 rounding draws differ)."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if any(not t.is_contiguous() or t.shape != param.shape for t in tensors):
        raise ValueError("adamw_update needs contiguous param, grad and moments of one shape")
    n_elements = param.numel()
    _adamw_kernel[(triton.cdiv(n_elements, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, n_elements, float(grad_scale), beta1, beta2, eps,
        1.0 - lr * weight_decay, lr / (1 - beta1 ** step), (1 - beta2 ** step) ** 0.5, seed % (2**31 - 1),
        first, BLOCK=BLOCK)
