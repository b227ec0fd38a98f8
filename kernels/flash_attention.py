"""Flash attention in Triton: causal, grouped-query, packed documents; forward and backward.

Layout as `kernels.reference.attention`: q [B, S, Hq, D], k and v [B, S, Hkv, D], read through their
strides (the last dim must be contiguous), query head h reading KV head h // (Hq // Hkv) without
repeating K/V. With `cu_seqlens` (int32 document offsets over the flattened B*S token axis) the batch is
folded into one row of B*S tokens and a token attends only to earlier tokens of its own document.

Memory is O(S): the forward saves the output and the per-row log-sum-exp (base 2) for the backward; no
S x S matrix exists anywhere. Per query block the kernels visit only the key tiles that its rows can see,
split in three runs: masked tiles where documents begin, unmasked tiles, masked tiles on the causal
diagonal / document end. A pack of short documents so costs about what the documents cost alone.

Under a recording `kernels.attention_tape.AttentionTape` the forward also hands (out, lse) to the tape;
under a replaying one it returns the taped output without running the forward kernel (checkpointing).

Backward: a preprocess kernel for delta = rowsum(dO * O); a dK/dV kernel per key block that loops over
the query heads of its group (dk/dv are summed in registers: deterministic, no atomics); a dQ kernel
per query block. On Hopper, 16-bit inputs take the one-pass Gluon backward instead
(kernels/flash_attention_hopper_backward.py: 5 products per tile where these two kernels make 7, dQ added
with TMA reductions, so not bit-identical run to run) unless `deterministic=True`, where Q's and dO's heads
are adjacent within a token and dO suits a tensor descriptor. kernels.dispatch asks for it only for packed
rows under a cuDNN memory plan (kernels/attention_workspace.py). Tiles are moved with tensor descriptors (TMA
on Hopper), which also zero-fill the rows past the end of the sequence.

On Hopper the forward of 16-bit inputs runs kernels/flash_attention_hopper.py instead (Gluon,
warp-specialized: faster than this Triton forward, and than cuDNN's from 8k to 131k tokens,
docs/PERFORMANCE.md); fp32 inputs, other
GPUs, Triton's interpreter and layouts whose heads do not lie within a token's row
(flash_attention_hopper.reads_as_rows) run the one here, which that kernel's tests hold it to.

Before Hopper (the A100, sm_80) Triton lowers the same source without TMA: its
rewrite-tensor-descriptor-to-pointer pass turns each descriptor load/store into masked pointer loads/stores,
and the products use mma.sync instead of wgmma. tests/test_sm80_compile.py compiles every kernel for sm_80;
TRITON_OVERRIDE_ARCH=sm80 makes Triton compile that A100 code on a Hopper GPU, to test and time it there.
Autotuning choices persist on disk (kernels/tuning_cache.py).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.utils.weak import WeakIdKeyDictionary
import triton
import triton.language as tl

from kernels import attention_tape, flash_attention_hopper, flash_attention_hopper_backward, tuning_cache
from kernels._attention_tiles import online_softmax, partner_range, tile_runs, token_documents, visible_pairs
from conf.schema.job import triton_interpreting
from kernels.reference import check_cu_seqlens

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _head_desc(base, seqlen, stride_s, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A [seqlen, HEAD_DIM] view of one head of one batch row, moved BLOCK tokens at a time."""
    return tl.make_tensor_descriptor(base, shape=[seqlen, HEAD_DIM], strides=[stride_s, 1],
                                     block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, n_start, n_tiles, offs_m, row_doc_lo, row_doc_hi, seqlen,
               qk_scale_log2, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
               MASKED: tl.constexpr):
    """Online softmax over n_tiles key tiles from n_start; m_i and the scores are in log2 units."""
    for tile in range(n_tiles):
        start = n_start + tile * BLOCK_N
        k = k_desc.load([start, 0])
        scores = tl.dot(q, tl.trans(k))
        if MASKED:
            offs_n = start + tl.arange(0, BLOCK_N)
            visible = visible_pairs(offs_m[:, None], offs_n[None, :], row_doc_lo[:, None], row_doc_hi[:, None],
                                    offs_n[None, :], seqlen, CAUSAL, HAS_DOCS)
            scores = tl.where(visible, scores, float("-inf"))
        p, alpha, m_new, l_i = online_softmax(scores, m_i, l_i, qk_scale_log2, MASKED)
        v = v_desc.load([start, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, DOC_START, DOC_END,
                     stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                     seqlen, qk_scale_log2, seq_bucket,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr):
    # Causal blocks late in the sequence do the most work: launch them first.
    m_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP
    q_desc = _head_desc(Q + batch * stride_qb + head * stride_qh, seqlen, stride_qs, BLOCK_M, HEAD_DIM)
    k_desc = _head_desc(K + batch * stride_kb + kv_head * stride_kh, seqlen, stride_ks, BLOCK_N, HEAD_DIM)
    v_desc = _head_desc(V + batch * stride_vb + kv_head * stride_vh, seqlen, stride_vs, BLOCK_N, HEAD_DIM)
    o_desc = _head_desc(O + batch * stride_ob + head * stride_oh, seqlen, stride_os, BLOCK_M, HEAD_DIM)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen
    row_doc_lo, row_doc_hi = token_documents(DOC_START, DOC_END, offs_m, row_ok, HAS_DOCS)
    lo, full_lo, full_hi, hi = partner_range(DOC_START, DOC_END, m_start, seqlen, BLOCK_M, CAUSAL, HAS_DOCS,
                                             KEYS=True)
    head_tiles, mid_tiles, tail_tiles = tile_runs(lo, full_lo, full_hi, hi, BLOCK_N)

    q = q_desc.load([m_start, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_start = lo
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, n_start, head_tiles, offs_m, row_doc_lo,
                               row_doc_hi, seqlen, qk_scale_log2, BLOCK_N, CAUSAL, HAS_DOCS, True)
    n_start += head_tiles * BLOCK_N
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, n_start, mid_tiles, offs_m, row_doc_lo,
                               row_doc_hi, seqlen, qk_scale_log2, BLOCK_N, CAUSAL, HAS_DOCS, False)
    n_start += mid_tiles * BLOCK_N
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, n_start, tail_tiles, offs_m, row_doc_lo,
                               row_doc_hi, seqlen, qk_scale_log2, BLOCK_N, CAUSAL, HAS_DOCS, True)

    # Every valid row sees at least itself, so l_i > 0 there; rows past the end are not stored.
    l_i = tl.where(row_ok, l_i, 1.0)
    o_desc.store([m_start, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))
    lse_ptrs = LSE + (batch * tl.num_programs(1) + head) * seqlen + offs_m
    tl.store(lse_ptrs, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _attn_bwd_delta_kernel(O, DO, DELTA, stride_ob, stride_os, stride_oh,
                           stride_dob, stride_dos, stride_doh, stride_dod, seqlen,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O), the softmax-backward correction for each query row."""
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seqlen
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(O + batch * stride_ob + head * stride_oh + rows * stride_os + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + batch * stride_dob + head * stride_doh + rows * stride_dos + offs_d[None, :] * stride_dod,
                 mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (batch * tl.num_programs(1) + head) * seqlen + offs_m, delta, mask=row_ok)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_desc, v_desc, n_start, n_tiles, offs_m, row_doc_lo, row_doc_hi, seqlen,
              qk_scale_log2, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
              MASKED: tl.constexpr):
    for tile in range(n_tiles):
        start = n_start + tile * BLOCK_N
        k = k_desc.load([start, 0])
        v = v_desc.load([start, 0])
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale_log2 - lse[:, None])
        if MASKED:
            offs_n = start + tl.arange(0, BLOCK_N)
            visible = visible_pairs(offs_m[:, None], offs_n[None, :], row_doc_lo[:, None], row_doc_hi[:, None],
                                    offs_n[None, :], seqlen, CAUSAL, HAS_DOCS)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, DOC_START, DOC_END,
                        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                        stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                        seqlen, sm_scale, qk_scale_log2, seq_bucket, stride_dqb, stride_dqs, stride_dqh,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr):
    m_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP
    q_desc = _head_desc(Q + batch * stride_qb + head * stride_qh, seqlen, stride_qs, BLOCK_M, HEAD_DIM)
    dq_desc = _head_desc(DQ + batch * stride_dqb + head * stride_dqh, seqlen, stride_dqs, BLOCK_M, HEAD_DIM)
    do_desc = _head_desc(DO + batch * stride_dob + head * stride_doh, seqlen, stride_dos, BLOCK_M, HEAD_DIM)
    k_desc = _head_desc(K + batch * stride_kb + kv_head * stride_kh, seqlen, stride_ks, BLOCK_N, HEAD_DIM)
    v_desc = _head_desc(V + batch * stride_vb + kv_head * stride_vh, seqlen, stride_vs, BLOCK_N, HEAD_DIM)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen
    row_doc_lo, row_doc_hi = token_documents(DOC_START, DOC_END, offs_m, row_ok, HAS_DOCS)
    row_stats = (batch * tl.num_programs(1) + head) * seqlen + offs_m
    lse = tl.load(LSE + row_stats, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row_stats, mask=row_ok, other=0.0)
    q = q_desc.load([m_start, 0])
    do = do_desc.load([m_start, 0])
    lo, full_lo, full_hi, hi = partner_range(DOC_START, DOC_END, m_start, seqlen, BLOCK_M, CAUSAL, HAS_DOCS,
                                             KEYS=True)
    head_tiles, mid_tiles, tail_tiles = tile_runs(lo, full_lo, full_hi, hi, BLOCK_N)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_start = lo
    dq = _dq_tiles(dq, q, do, lse, delta, k_desc, v_desc, n_start, head_tiles, offs_m, row_doc_lo, row_doc_hi,
                   seqlen, qk_scale_log2, BLOCK_N, CAUSAL, HAS_DOCS, True)
    n_start += head_tiles * BLOCK_N
    dq = _dq_tiles(dq, q, do, lse, delta, k_desc, v_desc, n_start, mid_tiles, offs_m, row_doc_lo, row_doc_hi,
                   seqlen, qk_scale_log2, BLOCK_N, CAUSAL, HAS_DOCS, False)
    n_start += mid_tiles * BLOCK_N
    dq = _dq_tiles(dq, q, do, lse, delta, k_desc, v_desc, n_start, tail_tiles, offs_m, row_doc_lo, row_doc_hi,
                   seqlen, qk_scale_log2, BLOCK_N, CAUSAL, HAS_DOCS, True)
    dq_desc.store([m_start, 0], (dq * sm_scale).to(DQ.dtype.element_ty))


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, LSE_ROW, DELTA_ROW, m_start, m_tiles, offs_n, key_doc_lo,
                key_doc_hi, seqlen, qk_scale_log2, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_DOCS: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate dk, dv of one key block over m_tiles query tiles from m_start (transposed scores)."""
    for tile in range(m_tiles):
        start = m_start + tile * BLOCK_M
        offs_m = start + tl.arange(0, BLOCK_M)
        q = q_desc.load([start, 0])
        lse = tl.load(LSE_ROW + offs_m, mask=offs_m < seqlen, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale_log2 - lse[None, :])
        if MASKED:
            visible = visible_pairs(offs_m[None, :], offs_n[:, None], key_doc_lo[:, None], key_doc_hi[:, None],
                                    offs_m[None, :], seqlen, CAUSAL, HAS_DOCS)
            p_t = tl.where(visible, p_t, 0.0)
        do = do_desc.load([start, 0])
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(DELTA_ROW + offs_m, mask=offs_m < seqlen, other=0.0)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, DOC_START, DOC_END,
                          stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                          stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                          seqlen, sm_scale, qk_scale_log2, seq_bucket, stride_dkb, stride_dks, stride_dkh,
                          stride_dvb, stride_dvs, stride_dvh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr):
    n_start = tl.program_id(0) * BLOCK_N  # causal: early key blocks do the most work and go first
    kv_head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    q_heads = tl.num_programs(1) * GROUP
    k_desc = _head_desc(K + batch * stride_kb + kv_head * stride_kh, seqlen, stride_ks, BLOCK_N, HEAD_DIM)
    v_desc = _head_desc(V + batch * stride_vb + kv_head * stride_vh, seqlen, stride_vs, BLOCK_N, HEAD_DIM)
    dk_desc = _head_desc(DK + batch * stride_dkb + kv_head * stride_dkh, seqlen, stride_dks, BLOCK_N, HEAD_DIM)
    dv_desc = _head_desc(DV + batch * stride_dvb + kv_head * stride_dvh, seqlen, stride_dvs, BLOCK_N, HEAD_DIM)

    offs_n = n_start + tl.arange(0, BLOCK_N)
    key_ok = offs_n < seqlen
    key_doc_lo, key_doc_hi = token_documents(DOC_START, DOC_END, offs_n, key_ok, HAS_DOCS)
    lo, full_lo, full_hi, hi = partner_range(DOC_START, DOC_END, n_start, seqlen, BLOCK_N, CAUSAL, HAS_DOCS,
                                             KEYS=False)
    head_tiles, mid_tiles, tail_tiles = tile_runs(lo, full_lo, full_hi, hi, BLOCK_M)
    k = k_desc.load([n_start, 0])
    v = v_desc.load([n_start, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # The group's query heads share this key block: summing them here needs no atomics.
    for head in range(kv_head * GROUP, kv_head * GROUP + GROUP):
        q_desc = _head_desc(Q + batch * stride_qb + head * stride_qh, seqlen, stride_qs, BLOCK_M, HEAD_DIM)
        do_desc = _head_desc(DO + batch * stride_dob + head * stride_doh, seqlen, stride_dos, BLOCK_M, HEAD_DIM)
        row_stats = (batch * q_heads + head) * seqlen
        m_start = lo
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, LSE + row_stats, DELTA + row_stats, m_start,
                             head_tiles, offs_n, key_doc_lo, key_doc_hi, seqlen, qk_scale_log2, BLOCK_M, CAUSAL,
                             HAS_DOCS, True)
        m_start += head_tiles * BLOCK_M
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, LSE + row_stats, DELTA + row_stats, m_start,
                             mid_tiles, offs_n, key_doc_lo, key_doc_hi, seqlen, qk_scale_log2, BLOCK_M, CAUSAL,
                             HAS_DOCS, False)
        m_start += mid_tiles * BLOCK_M
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, LSE + row_stats, DELTA + row_stats, m_start,
                             tail_tiles, offs_n, key_doc_lo, key_doc_hi, seqlen, qk_scale_log2, BLOCK_M, CAUSAL,
                             HAS_DOCS, True)
    dk_desc.store([n_start, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    dv_desc.store([n_start, 0], dv.to(DV.dtype.element_ty))


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

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

# Choices persist on disk (kernels/tuning_cache.py), so only a job's first run on a GPU pays for tuning.
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


# Longer sequences use the configs tuned at this length: tuning runs every candidate several times, which
# takes minutes at 524k tokens (a 524k attention forward alone takes seconds), and the best tile shapes
# stop changing with length well before it.
TUNE_MAX_SEQLEN = 131072
_tuned_on_prefix: set[tuple] = set()


def _seq_bucket(seqlen: int) -> int:
    return min(triton.next_power_of_2(seqlen), TUNE_MAX_SEQLEN)


def _needs_prefix_tuning(seqlen: int, key: tuple) -> bool:
    """Whether a call at `seqlen` should first tune on a TUNE_MAX_SEQLEN prefix (once per kernel key)."""
    return seqlen > TUNE_MAX_SEQLEN and key not in _tuned_on_prefix and not triton_interpreting()


def _tune_on_prefix(q, k, v, doc_start, doc_end, causal: bool, sm_scale: float, deterministic: bool,
                    key: tuple) -> None:
    """Run the forward and backward once on the first TUNE_MAX_SEQLEN tokens, so the autotuner picks the
    configs of this key there (seconds) and the long call reuses them. The backward is tuned here too,
    where memory is low, rather than in the first backward, where a long sequence's step peaks."""
    n = TUNE_MAX_SEQLEN
    bounds = (doc_start[:n], doc_end[:n].clamp(max=n)) if doc_start is not None else (None, None)
    q, k, v = q[:, :n], k[:, :n], v[:, :n]
    out, lse = _attention_forward(q, k, v, *bounds, causal, sm_scale)
    _attention_backward(out, q, k, v, out, lse, *bounds, causal, sm_scale, deterministic)  # any dO will do: out
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


def tma_compatible(t: torch.Tensor) -> bool:
    """Tensor descriptors need a contiguous last dim and 16-byte aligned base and strides."""
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all(s * t.element_size() % 16 == 0 and s > 0 for s in t.stride()[:3]))


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shapes, dtypes and devices the attention kernels take (kernels.cudnn_attention checks these too before
    running the Gluon forward), with an error naming what does not fit."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, S, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[3]} not supported; flash_attention supports {SUPPORTED_HEAD_DIMS}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype of {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_shapes(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {tuple(t.stride())}")
        if not tma_compatible(t):
            raise ValueError(f"{name} must be 16-byte aligned with 16-byte multiple strides, got strides "
                             f"{tuple(t.stride())}")


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _attention_forward(q, k, v, doc_start, doc_end, causal: bool, sm_scale: float):
    if flash_attention_hopper.takes(q, k, v):
        return flash_attention_hopper.attention_forward(q, k, v, doc_start, doc_end, causal, sm_scale * LOG2E)
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


def _attention_backward(do, q, k, v, out, lse, doc_start, doc_end, causal: bool, sm_scale: float,
                        deterministic: bool = True):
    batch, seqlen, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    has_docs = doc_start is not None
    delta = torch.empty_like(lse)
    delta_block = 16 if triton_interpreting() else 128
    _attn_bwd_delta_kernel[(triton.cdiv(seqlen, delta_block), q_heads, batch)](
        out, do, delta, *_strides3(out), *do.stride(), seqlen, HEAD_DIM=head_dim, BLOCK_M=delta_block)

    if (not deterministic and flash_attention_hopper.supports(q)
            and flash_attention_hopper_backward.supports(q, do) and tma_compatible(do)):
        return flash_attention_hopper_backward.attention_backward(do, q, k, v, lse, delta, doc_start, doc_end,
                                                                  causal, sm_scale, sm_scale * LOG2E)
    if not tma_compatible(do):
        # Autograd can hand a broadcast gradient (stride 0, e.g. from out.sum()) that no tensor descriptor
        # can describe: the only copy this op makes, and only for such layouts.
        do = do.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(GROUP=group, HEAD_DIM=head_dim, CAUSAL=causal, HAS_DOCS=has_docs, **_launch_options())
    args = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), seqlen, sm_scale, sm_scale * LOG2E,
            _seq_bucket(seqlen))
    _kernel("dq")[lambda meta: (triton.cdiv(seqlen, meta["BLOCK_M"]), q_heads, batch)](
        q, k, v, do, dq, lse, delta, doc_start, doc_end, *args, *_strides3(dq), **common)
    _kernel("dkdv")[lambda meta: (triton.cdiv(seqlen, meta["BLOCK_N"]), kv_heads, batch)](
        q, k, v, do, dk, dv, lse, delta, doc_start, doc_end, *args, *_strides3(dk), *_strides3(dv), **common)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, cu_seqlens, softmax_scale, deterministic: bool):
        _check_inputs(q, k, v)
        batch, seqlen = q.shape[:2]
        sm_scale = softmax_scale if softmax_scale is not None else q.shape[3] ** -0.5
        ensure_allocator(q.device)
        doc_start = doc_end = None
        if cu_seqlens is not None:
            doc_start, doc_end = _checked_document_bounds(cu_seqlens, batch, seqlen, q.device)
            q, k, v = _fold_batch(q, "q"), _fold_batch(k, "k"), _fold_batch(v, "v")
        tuning_key = (q.dtype, q.shape[2:], k.shape[2], causal, cu_seqlens is not None, deterministic)
        # Hopper's Gluon forward and one-pass backward tune nothing: no prefix run for them.
        gluon_only = flash_attention_hopper.takes(q, k, v) and not deterministic
        if not gluon_only and _needs_prefix_tuning(q.shape[1], tuning_key):
            _tune_on_prefix(q, k, v, doc_start, doc_end, causal, sm_scale, deterministic, tuning_key)
        saved = attention_tape.replayed(q)      # a checkpoint's recomputation: the first forward's result
        if saved is None:
            out, lse = _attention_forward(q, k, v, doc_start, doc_end, causal, sm_scale)
            attention_tape.record(out, lse)
        else:
            out, lse = saved
        ctx.save_for_backward(q, k, v, out, lse, doc_start, doc_end)
        ctx.causal, ctx.sm_scale, ctx.batch_shape = causal, sm_scale, (batch, seqlen)
        ctx.deterministic = deterministic
        return out.view(batch, seqlen, *out.shape[2:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, doc_start, doc_end = ctx.saved_tensors
        ensure_allocator(q.device)
        # Packed documents fold the batch; reshape is a view for any gradient the model produces.
        grad_out = grad_out.reshape(out.shape)
        dq, dk, dv = _attention_backward(grad_out, q, k, v, out, lse, doc_start, doc_end, ctx.causal, ctx.sm_scale,
                                         ctx.deterministic)
        batch, seqlen = ctx.batch_shape
        return (dq.view(batch, seqlen, *dq.shape[2:]), dk.view(batch, seqlen, *dk.shape[2:]),
                dv.view(batch, seqlen, *dv.shape[2:]), None, None, None, None)


def supports(head_dim: int, dtype: torch.dtype | None) -> bool:
    """Whether the kernels take this head dim and dtype (None: any dtype they take); under "auto",
    kernels.attention falls back to the reference otherwise."""
    return head_dim in SUPPORTED_HEAD_DIMS and (dtype is None or dtype in SUPPORTED_DTYPES)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    cu_seqlens: torch.Tensor | None = None, softmax_scale: float | None = None,
                    deterministic: bool = False) -> torch.Tensor:
    """Attention with the signature and layout of `kernels.reference.attention`; see the module doc.
    deterministic: a backward whose gradients are bit-identical run to run (the Triton two-kernel one)."""
    return FlashAttentionFunction.apply(q, k, v, causal, cu_seqlens, softmax_scale, deterministic)
