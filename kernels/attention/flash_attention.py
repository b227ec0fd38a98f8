"""Launchers of flash attention's Triton kernels (kernels/attention/triton_kernels.py): the inputs they take,
the autotuned configs (choices kept on disk: kernels/attention/tuning_cache.py), the forward and the
two-kernel backward. Which of these runs, and where the Gluon kernels or cuDNN's run instead, is
kernels/attention/route.py's choice; kernels/attention/function.py makes forward and backward one autograd
function.
"""
from __future__ import annotations

import torch
import triton

from conf.capability import triton_interpreting
import kernels.attention.tuning_cache as tuning_cache
from kernels.attention.support import TRITON_DTYPES, TRITON_HEAD_DIMS, tma_compatible
from kernels.attention.triton_kernels import (_attn_bwd_delta_kernel, _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel,
                                              _attn_fwd_kernel)

LOG2E = 1.4426950408889634

# Under the interpreter: one small fixed shape, no autotuning (it would run every config on the CPU).
_INTERPRET_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# H100 candidates, kept few so that tuning stays short; keyed on the sequence bucket and head dim.
_FWD_CONFIGS = [_config(128, 64, 8, 3), _config(128, 128, 8, 3), _config(128, 64, 4, 3),
                _config(128, 128, 8, 2), _config(64, 64, 4, 3), _config(128, 64, 8, 4)]
_DQ_CONFIGS = [_config(128, 64, 8, 3), _config(128, 32, 8, 3), _config(64, 64, 4, 3), _config(128, 64, 8, 2),
               _config(128, 128, 8, 2), _config(64, 32, 4, 4)]
_DKDV_CONFIGS = [_config(64, 128, 8, 3), _config(32, 128, 8, 3), _config(64, 64, 4, 3), _config(64, 128, 8, 2),
                 _config(32, 64, 4, 4), _config(128, 128, 8, 2)]
_TUNE_KEY = ["seq_bucket", "HEAD_DIM", "GROUP", "CAUSAL", "HAS_DOCS"]

# Choices persist on disk (tuning_cache.py), so only a job's first run on a GPU pays for tuning.
_TUNED = {
    "fwd": tuning_cache.autotune(_FWD_CONFIGS, _TUNE_KEY)(_attn_fwd_kernel),
    "dq": tuning_cache.autotune(_DQ_CONFIGS, _TUNE_KEY)(_attn_bwd_dq_kernel),
    "dkdv": tuning_cache.autotune(_DKDV_CONFIGS, _TUNE_KEY)(_attn_bwd_dkdv_kernel),
}
_PLAIN = {"fwd": _attn_fwd_kernel, "dq": _attn_bwd_dq_kernel, "dkdv": _attn_bwd_dkdv_kernel}


def tuned_configs() -> dict[str, str]:
    """The launch config the autotuner last picked for each kernel that has run (benchmarks print it)."""
    return {name: str(kernel.best_config) for name, kernel in _TUNED.items()
            if getattr(kernel, "best_config", None)}


def _kernel(name: str):
    """Autotuned when compiled; one fixed small config under the interpreter."""
    return _PLAIN[name] if triton_interpreting() else _TUNED[name]


def _launch_options() -> dict:
    return dict(_INTERPRET_BLOCKS) if triton_interpreting() else {}


def _scratch(size: int, alignment: int, stream):
    """Global memory for the tensor descriptors that kernels build on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator(device: torch.device) -> None:
    if device.type == "cuda":
        triton.set_allocator(_scratch)


# Longer sequences use the configs tuned at this length (function.py tunes them on a prefix): tuning runs every
# candidate several times, which takes minutes at the longest lengths, and the best tile shapes stop changing
# with length well before it.
TUNE_MAX_SEQLEN = 131072


def _seq_bucket(seqlen: int) -> int:
    return min(triton.next_power_of_2(seqlen), TUNE_MAX_SEQLEN)


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shapes, dtypes and devices the attention kernels take (kernels.attention.cudnn_attention checks these too
    before running the Gluon forward), with an error naming what does not fit."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, S, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if q.shape[3] not in TRITON_HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[3]} not supported; flash_attention supports {TRITON_HEAD_DIMS}")
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype of {TRITON_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_shapes(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {tuple(t.stride())}")
        if not tma_compatible(t):
            raise ValueError(f"{name} must be 16-byte aligned with 16-byte multiple strides, got strides "
                             f"{tuple(t.stride())}")


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)



def forward(q, k, v, doc_start, doc_end, causal: bool, sm_scale: float):
    """(out in q's layout, per-row log-sum-exp in base 2 [B, Hq, S] fp32) of inputs `check_inputs` accepts."""
    batch, seqlen, q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((batch, q_heads, seqlen), device=q.device, dtype=torch.float32)
    has_docs = doc_start is not None

    def grid(meta):
        return triton.cdiv(seqlen, meta["BLOCK_M"]), q_heads, batch

    _kernel("fwd")[grid](
        q, k, v, out, lse, doc_start, doc_end, *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out),
        seqlen, sm_scale * LOG2E, _seq_bucket(seqlen),
        GROUP=q_heads // k.shape[2], HEAD_DIM=head_dim, CAUSAL=causal, HAS_DOCS=has_docs, **_launch_options())
    return out, lse


def row_deltas(out, do, lse):
    """delta = rowsum(dO * O) per query row ([B, Hq, S] fp32, as lse), which both backwards take."""
    batch, seqlen, q_heads, head_dim = out.shape
    delta = torch.empty_like(lse)
    delta_block = 16 if triton_interpreting() else 128
    _attn_bwd_delta_kernel[(triton.cdiv(seqlen, delta_block), q_heads, batch)](
        out, do, delta, *_strides3(out), *do.stride(), seqlen, HEAD_DIM=head_dim, BLOCK_M=delta_block)
    return delta


def backward(do, q, k, v, lse, delta, doc_start, doc_end, causal: bool, sm_scale: float):
    """(dq, dk, dv) by the two-kernel backward: dK/dV per key block, dQ per query block, no atomics."""
    batch, seqlen, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if not tma_compatible(do):
        # Autograd can hand a broadcast gradient (stride 0, e.g. from out.sum()) that no tensor descriptor
        # can describe: the only copy this op makes, and only for such layouts.
        do = do.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, CAUSAL=causal, HAS_DOCS=doc_start is not None,
                  **_launch_options())
    args = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), seqlen, sm_scale, sm_scale * LOG2E,
            _seq_bucket(seqlen))
    _kernel("dq")[lambda meta: (triton.cdiv(seqlen, meta["BLOCK_M"]), q_heads, batch)](
        q, k, v, do, dq, lse, delta, doc_start, doc_end, *args, *_strides3(dq), **common)
    _kernel("dkdv")[lambda meta: (triton.cdiv(seqlen, meta["BLOCK_N"]), kv_heads, batch)](
        q, k, v, do, dk, dv, lse, delta, doc_start, doc_end, *args, *_strides3(dk), *_strides3(dv), **common)
    return dq, dk, dv
