"""Flash attention backward for Hopper (sm_90) in Gluon: one pass over key blocks, five products per tile.

Our backward on Hopper for 16-bit inputs where the route asks for it (kernels/attention/route.py; otherwise
the Triton two-kernel one runs: dK/dV, then dQ, 7 products, no atomics). Per CTA: one KV head and a block of
128 keys, over every query head of its group and every query tile of 64 rows that sees these keys.
Partitions (`gl.warp_specialize`, FlashAttention-3's layout for D = 128):
- a load warp: K and V of the block once, then each step's Q and dO tiles, with their rows' log-sum-exp
  and delta, into a two-stage ring;
- the compute partition, two warp groups (240 registers each), per query tile:
    S = Q Kᵀ, dP = dO Vᵀ                 (each warp group 64 of the 128 keys; queries as rows, so a thread
                                          holds the log-sum-exp and delta of two rows only)
    P = exp2(S·scale − lse), dS = P ∘ (dP − delta), both through shared memory
    dV += Pᵀ dO                          (each warp group its 64 keys)
    dQ = dS K, then dK += dSᵀ Q          (dQ: each warp group 64 of the head dims)
  dQ is added to an fp32 accumulator by a TMA reduction (cp.reduce.async.bulk) while dK is computed: other
  key blocks add to the same rows, so its sums are not bit-identical run to run. dK (times the softmax
  scale) and dV sum the group's query heads in registers and leave through the K/V buffers by TMA.
dQ added with per-thread atomics instead ran at half the speed (docs/PERFORMANCE.md, "Design choices measured").

The fp32 accumulator is [B, heads, S, D]; past attention_workspace.ONE_PASS_MAX_BYTES the kernel runs
over groups of KV heads, each with its query heads (their dQ is final after their group).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin

from kernels.attention.attention_workspace import one_pass_head_groups
from kernels.attention.flash_attention_hopper import (LOAD_REGISTERS, MAX_REGISTERS, _partner_range, _tile_runs,
                                                     _token_documents, _visible_pairs, barrier_ring)

BLOCK_N = 128                      # keys per CTA
BLOCK_M = 64                       # query rows per tile
NUM_STAGES = 2                     # Q and dO tiles in flight: 193 KiB of shared memory in all at D = 128
# TMA reads the statistics' rows from 16-byte aligned addresses: each head's rows, and each tile, start at a
# multiple of 4 floats (attention_backward pads the heads' rows of other lengths).
STATS_ALIGN = gl.constexpr(4)
MAX_GRID_Y = 65535                 # CUDA's limit on a grid's second axis (key blocks here)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[coord:] += src by TMA (cp.reduce.async.bulk.tensor). Triton 3.6's Gluon builds the op but has
    no wrapper for it; the compute partition waits for it with tma.store_wait as for a TMA store."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _head_view(base, seqlen, stride_s, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """A [seqlen, HEAD_DIM] view of one head of one batch row, moved BLOCK tokens at a time by TMA."""
    return tma.make_tensor_descriptor(base, shape=[seqlen, HEAD_DIM], strides=[stride_s, 1],
                                      block_shape=[BLOCK, HEAD_DIM], layout=layout)


@gluon.jit
def _load_partition(smem, bars, k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, stats0, stats_len,
                    n_start, first_head, lo, n_q_tiles, GROUP: gl.constexpr):
    """One warp: K and V once, then per query head of the group and query tile its Q and dO tiles (one
    descriptor each over all heads of the batch row: [seqlen, heads * D], a head's tile at column h * D), each
    with its rows' log-sum-exp or delta: loaded by the compute warps from global memory, these made the
    backward slower (docs/PERFORMANCE.md, "Design choices measured")."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = smem
    kv_bar, q_ready, do_ready, stage_free = bars
    NUM_STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n_start, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [n_start, 0], kv_bar, v_smem)
    step = 0
    for group_head in range(GROUP):
        column = (first_head + group_head) * HEAD_DIM
        stats = stats0 + group_head * stats_len
        for tile in range(n_q_tiles):
            stage = step % NUM_STAGES
            free_phase = ((step // NUM_STAGES) & 1) ^ 1
            start = lo + tile * BLOCK_M
            mbarrier.wait(stage_free.index(stage), free_phase)
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [start, column], q_ready.index(stage), q_smem.index(stage))
            tma.async_copy_global_to_shared(lse_desc, [(stats + start).to(gl.int32)], q_ready.index(stage),
                                            lse_smem.index(stage))
            mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [start, column], do_ready.index(stage), do_smem.index(stage))
            tma.async_copy_global_to_shared(delta_desc, [(stats + start).to(gl.int32)], do_ready.index(stage),
                                            delta_smem.index(stage))
            step += 1


@gluon.jit
def _all_heads_view(base, seqlen, stride_s, heads, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                    layout: gl.constexpr):
    """[seqlen, heads * HEAD_DIM] of one batch row (heads adjacent within a token: stride_h == HEAD_DIM)."""
    return tma.make_tensor_descriptor(base, shape=[seqlen, heads * HEAD_DIM], strides=[stride_s, 1],
                                      block_shape=[BLOCK, HEAD_DIM], layout=layout)


@gluon.jit
def _compute_partition(smem, bars, dk_desc, dv_desc, dq_desc, DOC_START, DOC_END, seqlen, dq_row0, n_start, lo,
                       head_tiles, mid_end, n_q_tiles, qk_scale_log2, sm_scale,
                       GROUP: gl.constexpr, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
    """Both warp groups: the steps over (query head of the group, query tile), then dK and dV. dq_row0: the
    group's first head's first row in the accumulator."""
    k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem = smem
    kv_bar, q_ready, do_ready, stage_free = bars
    NUM_STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    # [BLOCK_M, BLOCK_N] scores: the two warp groups side by side, 64 keys each.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    # [BLOCK_N, HEAD_DIM] dK and dV: the warp groups one above the other, 64 keys each.
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    # [BLOCK_M, HEAD_DIM] dQ: the warp groups side by side, half the head dims each.
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, HEAD_DIM // 2, 16])
    query_slice: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_slice: gl.constexpr = gl.SliceLayout(0, s_layout)

    keys = n_start + gl.arange(0, BLOCK_N, layout=key_slice)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)

    mbarrier.wait(kv_bar, 0)
    step = 0
    for group_head in range(GROUP):
        dq_row = dq_row0 + group_head * seqlen
        for tile in range(n_q_tiles):
            stage = step % NUM_STAGES
            phase = (step // NUM_STAGES) & 1
            start = lo + tile * BLOCK_M
            q_tile = q_smem.index(stage)
            do_tile = do_smem.index(stage)
            mbarrier.wait(q_ready.index(stage), phase)
            scores = warpgroup_mma(q_tile, k_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            lse = lse_smem.index(stage).load(query_slice)
            mbarrier.wait(do_ready.index(stage), phase)
            dp = warpgroup_mma(do_tile, v_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            queries = start + gl.arange(0, BLOCK_M, layout=query_slice)
            delta = delta_smem.index(stage).load(query_slice)
            scores = warpgroup_mma_wait(1, deps=(scores, ))
            if (tile < head_tiles) | (tile >= mid_end):
                # Read here (L1 hits), not held through every step: in registers, the keys' document bounds
                # made packed rows' backward slower (docs/PERFORMANCE.md, "Design choices measured").
                key_doc_lo, key_doc_hi = _token_documents(DOC_START, DOC_END, keys, keys < seqlen, HAS_DOCS)
                visible = _visible_pairs(queries[:, None], keys[None, :], key_doc_lo[None, :],
                                         key_doc_hi[None, :], queries[:, None], seqlen, CAUSAL, HAS_DOCS)
                scores = gl.where(visible, scores, float("-inf"))
            p = gl.exp2(scores * qk_scale_log2 - lse[:, None])
            p_smem.store(p.to(dtype))
            fence_async_shared()
            dv = warpgroup_mma(p_smem.permute((1, 0)), do_tile, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=(dp, ))
            ds = p * (dp - delta[:, None])
            ds_smem.store(ds.to(dtype))
            fence_async_shared()
            dq = warpgroup_mma(ds_smem, k_smem, zero_dq, use_acc=False, is_async=True)
            dk = warpgroup_mma(ds_smem.permute((1, 0)), q_tile, dk, is_async=True)
            dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))
            dq = dq * sm_scale
            # dQ goes out while dK is computed.
            tma.store_wait(0)
            dq_smem.store(dq)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [(dq_row + start).to(gl.int32), 0], dq_smem)
            dk = warpgroup_mma_wait(0, deps=(dk, ))
            mbarrier.arrive(stage_free.index(stage), count=1)
            step += 1

    tma.store_wait(0)
    # K and V are read by no one any more: they carry dK and dV to TMA.
    k_smem.store((dk * sm_scale).to(dtype))
    v_smem.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [n_start, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [n_start, 0], v_smem)
    tma.store_wait(0)


@gluon.jit
def _attn_bwd_kernel(Q, K, V, DO, DK, DV, DQ_ACC, LSE, DELTA, DOC_START, DOC_END,
                     stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                     stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                     seqlen, stats_len, q_heads, kv_head0, qk_scale_log2, sm_scale,
                     GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32)
    # Causal: early key blocks do the most work. They go first, of every KV head (the grid's fastest axis),
    # so the last wave is short (block order within each head in turn idled the GPU ~20% at 8k tokens in a
    # list-scheduling model).
    call_kv_head = gl.program_id(0)
    kv_head = kv_head0 + call_kv_head
    n_start = gl.program_id(1) * BLOCK_N
    batch = gl.program_id(2).to(gl.int64)
    call_q_heads = gl.num_programs(0) * GROUP
    k_desc = _head_view(K + batch * stride_kb + kv_head * stride_kh, seqlen, stride_ks, BLOCK_N, HEAD_DIM, kv_layout)
    v_desc = _head_view(V + batch * stride_vb + kv_head * stride_vh, seqlen, stride_vs, BLOCK_N, HEAD_DIM, kv_layout)
    dk_desc = _head_view(DK + batch * stride_dkb + kv_head * stride_dkh, seqlen, stride_dks, BLOCK_N, HEAD_DIM,
                         kv_layout)
    dv_desc = _head_view(DV + batch * stride_dvb + kv_head * stride_dvh, seqlen, stride_dvs, BLOCK_N, HEAD_DIM,
                         kv_layout)
    q_desc = _all_heads_view(Q + batch * stride_qb, seqlen, stride_qs, q_heads, BLOCK_M, HEAD_DIM, q_layout)
    do_desc = _all_heads_view(DO + batch * stride_dob, seqlen, stride_dos, q_heads, BLOCK_M, HEAD_DIM, q_layout)
    # dQ accumulates in fp32 laid out [B, this call's query heads, S, D]: a query tile of one head is one box
    # of [B * heads * S, D]. A tile's rows past the sequence's end are zero (their scores are masked) and
    # land in the next head's first rows: adding zeros there is harmless.
    dq_desc = tma.make_tensor_descriptor(DQ_ACC, shape=[gl.num_programs(2) * call_q_heads * seqlen, HEAD_DIM],
                                         strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=dq_layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], dq_layout)
    # The [B, Hq, stats_len] statistics as one row of floats: a tile's rows past its head's end read padding,
    # the next head's (finite: every row sees a key) or TMA's zeros past the end, harmless as their scores are
    # masked to P = 0, so dS = 0.
    stats_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    stats_rows = gl.num_programs(2) * q_heads * stats_len
    lse_desc = tma.make_tensor_descriptor(LSE, shape=[stats_rows], strides=[1], block_shape=[BLOCK_M],
                                          layout=stats_layout)
    delta_desc = tma.make_tensor_descriptor(DELTA, shape=[stats_rows], strides=[1], block_shape=[BLOCK_M],
                                            layout=stats_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stats_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stats_layout)
    # K and V once, Q's and dO's rings (arrivals by TMA), and one barrier per stage that frees it for both after
    # the step's last product: a barrier each cost the compute partition one more barrier of its 8 warps per
    # step, before the arrive of one thread (no faster: docs/PERFORMANCE.md, "Design choices measured").
    bars = (barrier_ring(1, 1).index(0), barrier_ring(NUM_STAGES, 1), barrier_ring(NUM_STAGES, 1),
            barrier_ring(NUM_STAGES, 1))

    lo, full_lo, full_hi, hi = _partner_range(DOC_START, DOC_END, n_start, seqlen, BLOCK_N, CAUSAL, HAS_DOCS,
                                              KEYS=False)
    # Query tiles start at an aligned row (its statistics' TMA box): only a non-causal packed row's first tile,
    # at a document's start, moves back (at most 3 rows), over rows of the documents before, which the mask
    # hides.
    lo = lo - lo % STATS_ALIGN
    head_tiles, mid_tiles, tail_tiles = _tile_runs(lo, full_lo, full_hi, hi, BLOCK_M)
    n_q_tiles = head_tiles + mid_tiles + tail_tiles
    first_head = kv_head * GROUP
    stats0 = (batch * q_heads + first_head) * stats_len
    dq_row0 = (batch * call_q_heads + call_kv_head * GROUP) * seqlen
    smem = (k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem)
    gl.warp_specialize([
        (_compute_partition, (smem, bars, dk_desc, dv_desc, dq_desc, DOC_START, DOC_END, seqlen, dq_row0, n_start,
                              lo, head_tiles, head_tiles + mid_tiles, n_q_tiles, qk_scale_log2, sm_scale, GROUP,
                              CAUSAL, HAS_DOCS)),
        (_load_partition, ((k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem), bars, k_desc, v_desc, q_desc,
                           do_desc, lse_desc, delta_desc, stats0, stats_len, n_start, first_head, lo, n_q_tiles,
                           GROUP)),
    ], [1], [LOAD_REGISTERS])


def supports(q: torch.Tensor, do: torch.Tensor) -> bool:
    """Beyond the forward's conditions (flash_attention_hopper.supports): Q and dO are read through one
    descriptor over all heads, so their heads must be adjacent within a token."""
    return q.stride(2) == q.shape[3] and do.stride(2) == do.shape[3] and do.stride(3) == 1


def attention_backward(do, q, k, v, lse, delta, doc_start, doc_end, causal: bool, sm_scale: float,
                       qk_scale_log2: float):
    """(dq, dk, dv) from dO, the inputs, the forward's base-2 log-sum-exp and delta = rowsum(dO * O), for
    inputs the forward's `supports` and this module's accept. Descriptors are built on the device: the
    caller has set Triton's allocator."""
    batch, seqlen, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    key_blocks = triton.cdiv(seqlen, BLOCK_N)
    if key_blocks > MAX_GRID_Y:
        raise ValueError(f"{seqlen} tokens in one row is more than this kernel's {MAX_GRID_Y * BLOCK_N}: split the "
                         "row (sequence parallelism, parallel.sequence) or use fewer tokens")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lse, delta = _aligned_statistics(lse, delta)
    groups = one_pass_head_groups(batch * seqlen, q_heads, kv_heads, head_dim)
    call_kv_heads = kv_heads // groups
    # One accumulator for every call: a second alive beside it would double the workspace the planner counts.
    dq_acc = torch.empty((batch, call_kv_heads * group, seqlen, head_dim), device=q.device, dtype=torch.float32)
    for first_kv_head in range(0, kv_heads, call_kv_heads):
        heads = slice(first_kv_head * group, (first_kv_head + call_kv_heads) * group)
        dq_acc.zero_()
        _attn_bwd_kernel[(call_kv_heads, key_blocks, batch)](
            q, k, v, do, dk, dv, dq_acc, lse, delta, doc_start, doc_end, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], seqlen, lse.shape[-1], q_heads,
            first_kv_head, qk_scale_log2, sm_scale,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES,
            CAUSAL=causal, HAS_DOCS=doc_start is not None, num_warps=8, maxnreg=MAX_REGISTERS)
        dq[:, :, heads].copy_(dq_acc.transpose(1, 2))     # the scale is in already; one pass casts and lays out
    return dq, dk, dv


def _aligned_statistics(lse: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lse and delta [B, Hq, S] as they are when S is a multiple of STATS_ALIGN; at other lengths, copies whose
    heads' rows are padded with zeros to the next multiple (8 bytes per query row and head)."""
    seqlen = lse.shape[-1]
    align = STATS_ALIGN.value
    if seqlen % align == 0:
        return lse, delta
    padded = torch.zeros((2, *lse.shape[:-1], triton.cdiv(seqlen, align) * align), device=lse.device,
                         dtype=torch.float32)
    padded[0, ..., :seqlen] = lse
    padded[1, ..., :seqlen] = delta
    return padded[0], padded[1]
