"""The Gluon forward's persistent CTAs take work items c, c + CTAs, ... (kernels/flash_attention_hopper.py,
`_work_item`). This model counts, for an order of the items, the most key tiles one CTA gets against the mean
(1.000: no CTA idles at the end) and how many KV heads the items of a round belong to, at Llama-3 8B's heads
(32 query heads, 8 KV heads), blocks of 128 queries, causal, on 132 CTAs (the H100 SXM's SMs) and 114 (the
PCIe card's). No GPU needed.

    python3 docs/experiments/work_item_order.py

Orders, a causal row's latest blocks (the heaviest) first unless said:
- heads fastest, then blocks, then batch rows (the kernel's);
- KV head by KV head: the query heads of one KV head fastest, then blocks, then KV heads, then batch rows;
  its runs of blocks alternate their direction, the last run heaviest first
  (docs/experiments/kv_major_order.patch);
- the same without alternating: every run heaviest first.
"Rounds" counts a round's KV heads as if every CTA took its items in step; CTAs drift apart in practice.

The one-pass backward launches a CTA per (KV head, key block) instead, and the GPU starts each CTA in grid
order as one ends: the second table is that list scheduling's time over the ideal (total work / CTAs), with
the KV heads the grid's fastest axis (the kernel's) or the key blocks (docs/experiments/kv_major_backward.patch,
from 32k tokens), a key block's work being the query tiles at and after it; one batch row, one launch."""
from __future__ import annotations

import heapq

Q_HEADS, GROUP, BLOCK_M = 32, 4, 128
KV_HEADS = Q_HEADS // GROUP


def heads_fastest(item: int, n_blocks: int, n_items: int) -> tuple[int, int]:
    """(KV head, block's rank from the last block) of the item."""
    return item % Q_HEADS // GROUP, item // Q_HEADS % n_blocks


def kv_head_by_kv_head(item: int, n_blocks: int, n_items: int, alternate: bool = True) -> tuple[int, int]:
    rest = item // GROUP
    run = rest // n_blocks
    block = rest % n_blocks
    if alternate and (n_items // (GROUP * n_blocks) - 1 - run) % 2 == 1:
        block = n_blocks - 1 - block
    return run % KV_HEADS, block


def kv_head_by_kv_head_heaviest_first(item: int, n_blocks: int, n_items: int) -> tuple[int, int]:
    return kv_head_by_kv_head(item, n_blocks, n_items, alternate=False)


ORDERS = (heads_fastest, kv_head_by_kv_head, kv_head_by_kv_head_heaviest_first)


def balance(order, seqlen: int, batch: int, ctas: int) -> tuple[float, float]:
    """(most key tiles of a CTA / mean, KV heads of a full round's items on average)."""
    n_blocks = -(-seqlen // BLOCK_M)
    n_items = batch * Q_HEADS * n_blocks
    items = [order(item, n_blocks, n_items) for item in range(n_items)]
    loads = [sum(n_blocks - rank for _, rank in items[cta::ctas]) for cta in range(ctas)]
    rounds = [{kv for kv, _ in items[start:start + ctas]} for start in range(0, n_items - ctas + 1, ctas)]
    return max(loads) * ctas / sum(loads), sum(map(len, rounds)) / len(rounds)


def backward_makespan(kv_heads_fastest: bool, seqlen: int, ctas: int) -> float:
    """List scheduling of the backward's CTAs in grid order: the last CTA's end over the ideal."""
    key_blocks = -(-seqlen // BLOCK_M)
    blocks = [index // KV_HEADS if kv_heads_fastest else index % key_blocks for index in range(key_blocks * KV_HEADS)]
    free = [0] * ctas
    end = 0
    for block in blocks:
        start = heapq.heappop(free)
        heapq.heappush(free, start + key_blocks - block)
        end = max(end, start + key_blocks - block)
    return end * ctas / sum(key_blocks - block for block in blocks)


LENGTHS = (4096, 8192, 16384, 32768, 33024, 40960, 57344, 65536, 131072)

if __name__ == "__main__":
    for ctas in (132, 114):
        for batch in (1, 2):
            print(f"\n{ctas} CTAs, batch {batch}: most loaded CTA / mean, KV heads a round")
            print("| tokens | " + " | ".join(order.__name__ for order in ORDERS) + " |\n|---|---|---|---|")
            for seqlen in LENGTHS:
                cells = (balance(order, seqlen, batch, ctas) for order in ORDERS)
                print(f"| {seqlen} | " + " | ".join(f"{most:.3f}, {kv:.1f}" for most, kv in cells) + " |")
    print("\n| tokens | backward, 132 CTAs, KV heads fastest | key blocks fastest | 114 CTAs, KV heads fastest "
          "| key blocks fastest |\n|---|---|---|---|---|")
    for seqlen in LENGTHS:
        print(f"| {seqlen} | " + " | ".join(f"{backward_makespan(kv_first, seqlen, ctas):.3f}"
                                            for ctas in (132, 114) for kv_first in (True, False)) + " |")
