"""Flash attention's Triton kernels: causal, grouped-query, packed documents; forward and two-kernel backward.

Layout as `kernels.reference.attention`: q [B, S, Hq, D], k and v [B, S, Hkv, D], read through their
strides (the last dim must be contiguous), query head h reading KV head h // (Hq // Hkv) without
repeating K/V. With packed documents the batch is folded into one row of B*S tokens (kernels/attention/function.py)
and a token attends only to earlier tokens of its own document, whose bounds DOC_START/DOC_END give per token.

Memory is O(S): the forward saves the output and the per-row log-sum-exp (base 2) for the backward; no
S x S matrix exists anywhere. Per query block the kernels visit only the key tiles that its rows can see,
split in three runs: masked tiles where documents begin, unmasked tiles, masked tiles on the causal
diagonal / document end. A pack of short documents so costs about what the documents cost alone.

Backward: a preprocess kernel for delta = rowsum(dO * O); a dK/dV kernel per key block that loops over
the query heads of its group (dk/dv are summed in registers: deterministic, no atomics); a dQ kernel
per query block. Tiles are moved with tensor descriptors (TMA on Hopper), which also zero-fill the rows past
the end of the sequence. The launchers are kernels/attention/flash_attention.py.

Before Hopper (the A100, sm_80) Triton lowers the same source without TMA: its
rewrite-tensor-descriptor-to-pointer pass turns each descriptor load/store into masked pointer loads/stores,
and the products use mma.sync instead of wgmma. tests/test_sm80_compile.py compiles every kernel for sm_80;
TRITON_OVERRIDE_ARCH=sm80 makes Triton compile that A100 code on a Hopper GPU, to test and time it there.
"""
import triton
import triton.language as tl

from kernels.attention._attention_tiles import online_softmax, partner_range, tile_runs, token_documents, visible_pairs


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
