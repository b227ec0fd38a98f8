"""The Gluon forward's persistent CTAs take work items c, c + CTAs, ... (kernels/flash_attention_hopper.py,
`_work_item`). This model counts, for an order of the items, the most key tiles one CTA gets against the mean
(1.00: no CTA idles at the end) and how many KV heads a round of items reads, at Llama-3 8B's heads (32 query
heads, 8 KV heads), blocks of 128 queries, causal, one batch row, 132 CTAs (the H100's SMs). No GPU needed.

    python3 docs/experiments/work_item_order.py

Orders: "heads fastest" (the kernel's), "KV head by KV head" (the query heads of one KV head fastest, then
blocks, then KV heads) and the same with every other round reversed (docs/experiments/kv_major_order.patch).
In both, a causal row's latest blocks, the heaviest, come first.

The one-pass backward launches a CTA per (KV head, key block) instead, and the GPU starts each CTA in grid
order as one ends: the second table is that list scheduling's time over the ideal (total work / 132), with
the KV heads the grid's fastest axis (the kernel's) or the key blocks (docs/experiments/kv_major_backward.patch,
from 32k tokens), a key block's work being the query tiles at and after it."""
from __future__ import annotations

import heapq

CTAS, Q_HEADS, GROUP, BLOCK_M = 132, 32, 4, 128


def heads_fastest(item: int, n_blocks: int, n_items: int) -> tuple[int, int]:
    """(KV head, block's rank from the last block)."""
    return item % Q_HEADS // GROUP, item // Q_HEADS % n_blocks


def kv_head_by_kv_head(item: int, n_blocks: int, n_items: int) -> tuple[int, int]:
    rest = item // GROUP
    return rest // n_blocks % (Q_HEADS // GROUP), rest % n_blocks


def kv_head_by_kv_head_reversed_rounds(item: int, n_blocks: int, n_items: int) -> tuple[int, int]:
    round_start = item - item % CTAS
    if item // CTAS % 2 == 1:
        item = round_start + min(CTAS, n_items - round_start) - 1 - item % CTAS
    return kv_head_by_kv_head(item, n_blocks, n_items)


def balance(order, seqlen: int) -> tuple[float, float]:
    """(most key tiles of a CTA / mean, KV heads a full round reads on average)."""
    n_blocks = seqlen // BLOCK_M
    n_items = Q_HEADS * n_blocks
    items = [order(item, n_blocks, n_items) for item in range(n_items)]
    loads = [sum(n_blocks - rank for _, rank in items[cta::CTAS]) for cta in range(CTAS)]
    rounds = [{kv for kv, _ in items[start:start + CTAS]} for start in range(0, n_items - CTAS + 1, CTAS)]
    return max(loads) * CTAS / sum(loads), sum(map(len, rounds)) / len(rounds)


def backward_makespan(kv_heads_fastest: bool, seqlen: int) -> float:
    """List scheduling of the backward's CTAs in grid order: the last CTA's end over the ideal."""
    key_blocks, kv_heads = seqlen // BLOCK_M, Q_HEADS // GROUP
    blocks = [index // kv_heads if kv_heads_fastest else index % key_blocks for index in range(key_blocks * kv_heads)]
    free = [0] * CTAS
    end = 0
    for block in blocks:
        start = heapq.heappop(free)
        heapq.heappush(free, start + key_blocks - block)
        end = max(end, start + key_blocks - block)
    return end * CTAS / sum(key_blocks - block for block in blocks)


if __name__ == "__main__":
    print("| tokens | " + " | ".join(order.__name__ for order in
                                       (heads_fastest, kv_head_by_kv_head, kv_head_by_kv_head_reversed_rounds)) + " |")
    print("|---|---|---|---|")
    for seqlen in (8192, 32768, 65536, 131072):
        cells = (balance(order, seqlen) for order in (heads_fastest, kv_head_by_kv_head,
                                                       kv_head_by_kv_head_reversed_rounds))
        print(f"| {seqlen} | " + " | ".join(f"{most:.3f}, {kv_heads:.1f} KV heads" for most, kv_heads in cells) + " |")
    print("\n| tokens | backward, KV heads fastest | backward, key blocks fastest |\n|---|---|---|")
    for seqlen in (4096, 8192, 16384, 32768, 65536, 131072):
        print(f"| {seqlen} | {backward_makespan(True, seqlen):.3f} | {backward_makespan(False, seqlen):.3f} |")
