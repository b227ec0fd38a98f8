"""Flash attention forward for Hopper (sm_90) in Gluon, warp-specialized as FlashAttention-3 is.

The contract is `kernels.attention.flash_attention.forward`'s: q [B, S, Hq, D], k and v [B, S, Hkv, D]
read through their strides (a token's heads within its row: `reads_as_rows`), optional per-token document
bounds (packed documents folded into one row), causal or not; it returns the output in q's layout and the
per-row log-sum-exp in base 2 ([B, Hq, S], fp32) that the backwards (Triton's, the one-pass Gluon one,
cuDNN's through kernels/attention/cudnn_attention.py) and the attention tape take.
Only the forward is here.

Why Gluon: Triton's `tl.dot` waits for each product before the next statement, and Triton 3.6 makes no
warp groups of different roles on Hopper, so a tile's softmax and its products run one after the other
(the Triton forward's and cuDNN's figures: docs/PERFORMANCE.md, "Attention").
Here a work item is 128 query rows of one head; a persistent CTA per SM takes items in turn, with three
partitions (`gl.warp_specialize`):
- a load warp (24 registers) moves an item's Q and then each key tile's K and V by TMA into a two-stage
  ring, refilling a stage when both row groups have signalled (mbarriers) that they are done with it, and
  runs into the next item while the row groups end the last (a CTA per item, the next one waiting for the
  last to end, was slower on packed documents and short rows: docs/PERFORMANCE.md, "Design choices measured");
- two row groups of one warp group each (64 rows, 240 registers) issue S(t) = Q·K(t)ᵀ and then
  O += P(t-1)·V(t-1) asynchronously, wait for S(t) only, and compute P(t) while P·V runs. The two groups
  take turns to issue their products (FlashAttention-3's ping-pong, on an mbarrier each), so one group's
  softmax runs while the tensor cores do the other's products (without turns slower at 131k, the same
  elsewhere: docs/PERFORMANCE.md, "Design choices measured").

Key tiles are visited as in the Triton kernel: those a block of queries sees in part (document starts,
the causal diagonal, document ends) apply a mask, the ones it sees whole do not.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from conf.capability import gpu_capability
import kernels.attention._attention_tiles as _attention_tiles

GROUP_ROWS = gl.constexpr(64)          # query rows per row group (one warp group: wgmma's M is 64)
BLOCK_N = 128                          # keys per tile
NUM_STAGES = 2                         # K and V tiles in flight: Q (32 KiB) + 2 x (K + V) (128 KiB) at D=128
# Registers per thread: 168 for the CTA's 12 warps (3 warp groups, the load warp's group rounded up) fill
# the register file; setmaxnreg moves them from the load warp to the row groups.
MAX_REGISTERS = 168
ROWS_REGISTERS = gl.constexpr(240)
LOAD_REGISTERS = gl.constexpr(24)
SUPPORTED_HEAD_DIMS = (64, 128)
# Query blocks a row from which work items go KV head by KV head (_work_item): 32k tokens, where it was
# measured to matter. Rows of documents never do: each document's own causal triangle upsets the order's
# balance (16 documents of 4k tokens ran 20% slower in it).
KV_MAJOR_BLOCKS = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


# The Triton kernels' tile arithmetic, masks and softmax step, compiled as Gluon.
_partner_range = gluon.jit(_attention_tiles.partner_range.fn)
_tile_runs = gluon.jit(_attention_tiles.tile_runs.fn)
_visible_pairs = gluon.jit(_attention_tiles.visible_pairs.fn)
_token_documents = gluon.jit(_attention_tiles.token_documents.fn)
_online_softmax = gluon.jit(_attention_tiles.online_softmax.fn)


@gluon.jit
def _load_tile(desc, row, column, bar, dest):
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, column], bar, dest)


@gluon.jit
def _masked_scores(scores, start, offs_m, row_doc_lo, row_doc_hi, seqlen, s_layout: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
    """-inf where a query row does not see the key (past the sequence, in its future, another document)."""
    keys = (start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)))[None, :]
    visible = _visible_pairs(offs_m[:, None], keys, row_doc_lo[:, None], row_doc_hi[:, None], keys, seqlen, CAUSAL,
                             HAS_DOCS)
    return gl.where(visible, scores, float("-inf"))


@gluon.jit
def _is_masked(tile, head_tiles, mid_end):
    return (tile < head_tiles) | (tile >= mid_end)


@gluon.jit
def _softmax_step(scores, start, masked, m_i, l_i, offs_m, row_doc_lo, row_doc_hi, seqlen, qk_scale_log2,
                  s_layout: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
    """_online_softmax of the key tile from `start`, its scores masked first if the tile is one the block
    sees in part (`masked`, known only at run time)."""
    if masked:
        scores = _masked_scores(scores, start, offs_m, row_doc_lo, row_doc_hi, seqlen, s_layout, BLOCK_N,
                                CAUSAL, HAS_DOCS)
        p, alpha, m_new, l_new = _online_softmax(scores, m_i, l_i, qk_scale_log2, True)
    else:
        p, alpha, m_new, l_new = _online_softmax(scores, m_i, l_i, qk_scale_log2, False)
    return p, alpha, m_new, l_new


@gluon.jit
def _take_turn(turns, GROUP_INDEX: gl.constexpr, turns_taken):
    """Wait until the other row group has issued its products of the step (group 0 goes first: a new
    mbarrier counts as having completed phase 1)."""
    mbarrier.wait(turns.index(GROUP_INDEX), (turns_taken & 1) ^ (1 - GROUP_INDEX))


@gluon.jit
def _pass_turn(turns, GROUP_INDEX: gl.constexpr, turns_taken):
    """This group's products of the step are issued: the other group may issue its own."""
    mbarrier.arrive(turns.index(1 - GROUP_INDEX), count=1)
    return turns_taken + 1


@gluon.jit
def barrier_ring(NUM_STAGES: gl.constexpr, ARRIVALS: gl.constexpr):
    """NUM_STAGES mbarriers, each completed by ARRIVALS arrivals (a TMA load's: 1, its expect)."""
    ring = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ring.index(i), count=ARRIVALS)
    return ring


@gluon.jit
def _work_item(item, schedule, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
    """The item-th (query head, first query row, batch row) and its key tiles: the first one's start, where
    the masked head run ends and the masked tail run begins, and their count (at least one: every query row
    sees a key, itself when causal, its non-empty document). The CTAs take a round of items at a time
    (`_round_item`).
    - Below `kv_major_blocks` query blocks a row, and in rows of documents, items go heads fastest, then a
      causal row's latest blocks, which do the most work, first, then batch rows: every round is about as
      heavy across the CTAs (block order within each head in turn left the GPU 5% idle at the end at 8k
      tokens in a list-scheduling model).
    - From there, the query heads of one KV head fastest, then blocks, then KV heads, then batch rows, so that
      a round reads the keys and values of one or two KV heads instead of all 8 (Llama-3 8B), which all its
      CTAs then share through L2. At the power limit the HBM traffic that this saves is speed: at 131k the
      forward ran 6% faster with one KV head than with 8, and this order with mirrored rounds ran 4-5%
      faster at 32k and 131k than heads fastest (docs/PERFORMANCE.md). The runs of blocks alternate their
      direction, the last run heaviest first, so that no CTA's items are all the heavy ends of runs: with
      the mirrored rounds, the most loaded of 132 CTAs is within 0.1% of their mean from 32k tokens, batch 1
      or 2 (114 CTAs: 1.1%; scripts/experiments/work_item_order.py)."""
    n_items, n_blocks, q_heads, seqlen, DOC_START, DOC_END, kv_major_blocks = schedule
    if not HAS_DOCS and n_blocks >= kv_major_blocks:
        kv_heads = q_heads // GROUP
        rest = item // GROUP
        run = rest // n_blocks                # (batch row, KV head)
        head = run % kv_heads * GROUP + item % GROUP
        block = rest % n_blocks
        if (n_items // (GROUP * n_blocks) - 1 - run) % 2 == 1:
            block = n_blocks - 1 - block
        batch = run // kv_heads
    else:
        head = item % q_heads
        rest = item // q_heads
        block = rest % n_blocks
        batch = rest // n_blocks
    m_start = (n_blocks - 1 - block) * BLOCK_M
    lo, full_lo, full_hi, hi = _partner_range(DOC_START, DOC_END, m_start, seqlen, BLOCK_M, CAUSAL, HAS_DOCS,
                                              KEYS=True)
    head_tiles, mid_tiles, tail_tiles = _tile_runs(lo, full_lo, full_hi, hi, BLOCK_N)
    n_tiles = head_tiles + mid_tiles + tail_tiles
    return head, m_start, batch, lo, head_tiles, head_tiles + mid_tiles, n_tiles


@gluon.jit
def _round_item(index):
    """The item this CTA takes in its index-th round: CTA c takes the round's c-th item, then, in the next
    round, the c-th from the end. A CTA given a heavier item than another in one round gets the lighter in
    the next, so the CTAs end each pair of rounds together instead of drifting apart round after round; in
    step, the CTAs of one KV head read each key tile at about the same time, once from HBM and then from L2
    (with work items KV head by KV head, the long forward ran faster than with CTA c taking items c,
    c + num_programs, ...: docs/PERFORMANCE.md, "Design choices measured")."""
    ctas = gl.num_programs(0)
    return index * ctas + gl.program_id(0) + index % 2 * (ctas - 1 - 2 * gl.program_id(0))


@gluon.jit
def _items_of_this_cta(n_items):
    """How many work items this CTA takes (`_round_item`): one in every full round of `num_programs` items,
    and one in the last, partial round if its place there holds an item."""
    full_rounds = n_items // gl.num_programs(0)
    return full_rounds + (_round_item(full_rounds) < n_items).to(gl.int32)


@gluon.jit
def _load_partition(smem, bars, descs, schedule, stride_qh, stride_kh, GROUP: gl.constexpr,
                    CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
    """One warp, for each work item of this CTA: Q once it is free, then each key tile's K and V into the
    ring as soon as both row groups freed it. It runs ahead into the next item while the row groups finish
    the last one."""
    q_smem, k_smem, v_smem = smem
    q_ready, q_free, k_ready, k_free, v_ready, v_free, _ = bars
    q_desc, k_desc, v_desc = descs
    n_items, n_blocks, q_heads, seqlen, DOC_START, DOC_END, _ = schedule
    NUM_STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    tiles_before = 0
    items_before = 0
    for index in range(_items_of_this_cta(n_items)):
        head, m_start, batch, lo, head_tiles, mid_end, n_tiles = _work_item(_round_item(index), schedule, GROUP,
                                                                           BLOCK_M, BLOCK_N, CAUSAL, HAS_DOCS)
        row0 = batch * seqlen       # the batch row's first row in the [B * S, columns] views
        mbarrier.wait(q_free, (items_before & 1) ^ 1)     # a new mbarrier counts as having completed phase 1
        _load_tile(q_desc, (row0 + m_start).to(gl.int32), head * stride_qh, q_ready, q_smem)
        kv_column = (head // GROUP) * stride_kh
        for tile in range(n_tiles):
            count = tiles_before + tile
            stage = count % NUM_STAGES
            free_phase = ((count // NUM_STAGES) & 1) ^ 1
            row = (row0 + lo + tile * BLOCK_N).to(gl.int32)
            mbarrier.wait(k_free.index(stage), free_phase)
            _load_tile(k_desc, row, kv_column, k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_free.index(stage), free_phase)
            _load_tile(v_desc, row, kv_column, v_ready.index(stage), v_smem.index(stage))
        tiles_before += n_tiles
        items_before += 1


@gluon.jit
def _rows_partition(smem, bars, schedule, OUT, LSE, stride_ob, stride_os, stride_oh, qk_scale_log2,
                    GROUP_INDEX: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
    """One warp group, for each work item of this CTA: the block's rows [GROUP_INDEX * 64, +64) over every
    key tile, then their output and log-sum-exp."""
    q_smem, k_smem, v_smem = smem
    q_ready, q_free, k_ready, k_free, v_ready, v_free, turns = bars
    n_items, n_blocks, q_heads, seqlen, DOC_START, DOC_END, _ = schedule
    NUM_STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    ROWS: gl.constexpr = GROUP_ROWS
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    columns = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    q_rows = q_smem.slice(GROUP_INDEX * ROWS, ROWS)

    tiles_before = 0
    items_before = 0
    turns_taken = 0
    for index in range(_items_of_this_cta(n_items)):
        head, m_start, batch, lo, head_tiles, mid_end, n_tiles = _work_item(_round_item(index), schedule, GROUP,
                                                                           BLOCK_M, BLOCK_N, CAUSAL, HAS_DOCS)
        offs_m = m_start + GROUP_INDEX * ROWS + gl.arange(0, ROWS, layout=row_s)
        row_doc_lo, row_doc_hi = _token_documents(DOC_START, DOC_END, offs_m, offs_m < seqlen, HAS_DOCS)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([ROWS], gl.float32, row_s)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

        # Tile 0: its scores and probabilities alone.
        stage = tiles_before % NUM_STAGES
        mbarrier.wait(q_ready, items_before & 1)
        mbarrier.wait(k_ready.index(stage), (tiles_before // NUM_STAGES) & 1)
        _take_turn(turns, GROUP_INDEX, turns_taken)
        scores = warpgroup_mma(q_rows, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        turns_taken = _pass_turn(turns, GROUP_INDEX, turns_taken)
        scores = warpgroup_mma_wait(0, deps=(scores, ))
        mbarrier.arrive(k_free.index(stage), count=1)
        p, alpha, m_i, l_i = _softmax_step(scores, lo, _is_masked(0, head_tiles, mid_end), m_i, l_i, offs_m,
                                          row_doc_lo, row_doc_hi, seqlen, qk_scale_log2, s_layout, BLOCK_N, CAUSAL,
                                          HAS_DOCS)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for tile in range(1, n_tiles):
            count = tiles_before + tile
            stage = count % NUM_STAGES
            prev = (count - 1) % NUM_STAGES
            # S(tile) and then O += P(tile-1) V(tile-1): wgmma groups complete in order, so waiting until one
            # is left outstanding waits for the scores only, and the softmax below overlaps the P.V product.
            mbarrier.wait(k_ready.index(stage), (count // NUM_STAGES) & 1)
            _take_turn(turns, GROUP_INDEX, turns_taken)
            scores = warpgroup_mma(q_rows, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
            mbarrier.wait(v_ready.index(prev), ((count - 1) // NUM_STAGES) & 1)
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            turns_taken = _pass_turn(turns, GROUP_INDEX, turns_taken)
            scores = warpgroup_mma_wait(1, deps=(scores, ))
            mbarrier.arrive(k_free.index(stage), count=1)
            p, alpha, m_i, l_i = _softmax_step(scores, lo + tile * BLOCK_N, _is_masked(tile, head_tiles, mid_end),
                                              m_i, l_i, offs_m, row_doc_lo, row_doc_hi, seqlen, qk_scale_log2,
                                              s_layout, BLOCK_N, CAUSAL, HAS_DOCS)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(v_free.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        # Every product with Q is done: the load warp may bring the next item's.
        mbarrier.arrive(q_free, count=1)
        last = tiles_before + n_tiles - 1
        mbarrier.wait(v_ready.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
        _take_turn(turns, GROUP_INDEX, turns_taken)
        acc = warpgroup_mma(p_op, v_smem.index(last % NUM_STAGES), acc, is_async=True)
        turns_taken = _pass_turn(turns, GROUP_INDEX, turns_taken)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_free.index(last % NUM_STAGES), count=1)

        # Every valid row sees at least itself, so l_i > 0 there. Stored from registers, rows past the end
        # left out: a TMA store of the block would write them into the next batch row.
        row_ok = offs_m < seqlen
        l_i = gl.where(row_ok, l_i, 1.0)
        out = acc / gl.convert_layout(l_i, row_o)[:, None]
        rows = gl.convert_layout(offs_m, row_o)
        out_ptrs = (OUT + batch.to(gl.int64) * stride_ob + head * stride_oh + rows.to(gl.int64)[:, None] * stride_os
                    + columns[None, :])
        gl.store(out_ptrs, out.to(dtype), mask=(rows < seqlen)[:, None])
        gl.store(LSE + (batch * q_heads + head) * seqlen + offs_m, m_i + gl.log2(l_i), mask=row_ok)
        tiles_before += n_tiles
        items_before += 1


@gluon.jit
def _rows_view(base, rows, row_stride, heads, head_stride, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
               layout: gl.constexpr):
    """Every batch row and head of q, k or v as one [rows, columns] view: a head's tile of BLOCK tokens is
    the box at (token's row, head * head_stride). Batch rows must follow one another at the token stride.
    A tile crossing a batch row's end reads the next row's first tokens, not zeros: masked (P = 0), they
    change nothing as long as they are finite (0 * inf would be NaN)."""
    return tma.make_tensor_descriptor(base, shape=[rows, (heads - 1) * head_stride + HEAD_DIM],
                                      strides=[row_stride, 1], block_shape=[BLOCK, HEAD_DIM], layout=layout)


@gluon.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, DOC_START, DOC_END,
                     stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                     batch_rows, seqlen, q_heads, kv_heads, qk_scale_log2, kv_major_blocks,
                     GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                     NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
    """Persistent: each CTA takes one work item (query head, block of 128 query rows, batch row) a round
    (`_round_item`); its load warp brings the next item's Q and first key tiles while the row groups
    finish the last one's, which hides the start and end of an item (at 16 x 4k packed documents a CTA of
    one item each spent about 4 key tiles' time outside its tiles: a fit of 8k, 32k and packed timings)."""
    BLOCK_M: gl.constexpr = 2 * GROUP_ROWS
    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    rows = batch_rows * seqlen
    descs = (_rows_view(Q, rows, stride_qs, q_heads, stride_qh, BLOCK_M, HEAD_DIM, q_layout),
             _rows_view(K, rows, stride_ks, kv_heads, stride_kh, BLOCK_N, HEAD_DIM, kv_layout),
             _rows_view(V, rows, stride_vs, kv_heads, stride_vh, BLOCK_N, HEAD_DIM, kv_layout))
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    # Arrivals by TMA (ready) and by both row groups (free).
    q_ready, q_free = barrier_ring(1, 1).index(0), barrier_ring(1, 2).index(0)
    k_ready, k_free = barrier_ring(NUM_STAGES, 1), barrier_ring(NUM_STAGES, 2)
    v_ready, v_free = barrier_ring(NUM_STAGES, 1), barrier_ring(NUM_STAGES, 2)
    bars = (q_ready, q_free, k_ready, k_free, v_ready, v_free, barrier_ring(2, 1))
    smem = (q_smem, k_smem, v_smem)
    n_blocks = gl.cdiv(seqlen, BLOCK_M)
    schedule = (batch_rows * n_blocks * q_heads, n_blocks, q_heads, seqlen, DOC_START, DOC_END, kv_major_blocks)
    gl.warp_specialize([
        (_rows_partition, (smem, bars, schedule, O, LSE, stride_ob, stride_os, stride_oh, qk_scale_log2, 0, GROUP,
                           CAUSAL, HAS_DOCS)),
        (_rows_partition, (smem, bars, schedule, O, LSE, stride_ob, stride_os, stride_oh, qk_scale_log2, 1, GROUP,
                           CAUSAL, HAS_DOCS)),
        (_load_partition, (smem, bars, descs, schedule, stride_qh, stride_kh, GROUP, CAUSAL, HAS_DOCS)),
    ], [4, 1], [ROWS_REGISTERS, LOAD_REGISTERS])


def attention_forward(q, k, v, doc_start, doc_end, causal: bool, qk_scale_log2: float):
    """(out, lse) as kernels.attention.flash_attention.forward, for inputs that `takes` accepts, with
    strides that suit tensor descriptors (support.tma_compatible); lse in base 2. Descriptors are
    built on the device: the caller has set Triton's allocator."""
    batch, seqlen, q_heads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((batch, q_heads, seqlen), device=q.device, dtype=torch.float32)
    if batch == 1 or all(t.stride(0) == seqlen * t.stride(1) for t in (q, k, v, out)):
        _launch(q, k, v, out, lse, doc_start, doc_end, causal, qk_scale_log2)
    else:   # the kernel reads batch rows as one run of rows: rows apart from one another go one at a time
        for row in range(batch):
            rows = slice(row, row + 1)
            _launch(q[rows], k[rows], v[rows], out[rows], lse[rows], doc_start, doc_end, causal, qk_scale_log2)
    return out, lse


def _launch(q, k, v, out, lse, doc_start, doc_end, causal: bool, qk_scale_log2: float) -> None:
    batch, seqlen, q_heads, head_dim = q.shape
    items = batch * q_heads * triton.cdiv(seqlen, 2 * GROUP_ROWS.value)
    _attn_fwd_kernel[(min(items, _multiprocessors(q.device)), )](
        q, k, v, out, lse, doc_start, doc_end, q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1),
        v.stride(2), *out.stride()[:3], batch, seqlen, q_heads, k.shape[2], qk_scale_log2, KV_MAJOR_BLOCKS,
        GROUP=q_heads // k.shape[2], HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, CAUSAL=causal,
        HAS_DOCS=doc_start is not None, num_warps=4, maxnreg=MAX_REGISTERS)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def reads_as_rows(*tensors: torch.Tensor) -> bool:
    """Whether the kernel can read each [B, S, H, D] tensor as one view of [B * S rows, a token's heads]: its
    heads at least D apart and within the token stride (true of [B, S, H, D] layouts, not of [B, H, S, D]
    ones, which the Triton forward takes)."""
    return all(t.stride(2) >= t.shape[3] and t.stride(1) >= (t.shape[2] - 1) * t.stride(2) + t.shape[3]
               for t in tensors)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether attention_forward runs these inputs: q as `supports` asks, all three read as rows."""
    return supports(q) and reads_as_rows(q, k, v)


def supports(q: torch.Tensor) -> bool:
    """Whether this kernel runs q's dtype and head dim on q's device (16-bit, D of 64 or 128, on a GPU that
    runs Hopper code: conf.capability's `hopper`)."""
    return q.shape[-1] in SUPPORTED_HEAD_DIMS and q.dtype in SUPPORTED_DTYPES and gpu_capability(q.device).hopper


