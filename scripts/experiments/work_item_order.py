"""The Gluon forward's persistent CTAs take a round of work items at a time
(kernels/attention/flash_attention_hopper.py, `_work_item`, `_round_item`). This model counts, for an order of the
items and their sharing among the CTAs, the most key tiles one CTA gets against the mean (1.000: no CTA idles at the
end), how many KV heads the items of a round belong to, and the mean "window": the keys and values (MiB) between the
CTAs furthest apart in each KV head's stream, summed over the KV heads at work, sampled over the run, CTAs taking as
long as their tiles (the less, the sooner a tile read from HBM is read again by another CTA, from L2 (50 MB on the
H100)). At Llama-3 8B's heads (32 query heads, 8 KV heads), blocks of 128 queries and tiles of 128 keys, causal, on
132 CTAs (the H100 SXM's SMs) and 114 (the PCIe card's). No GPU needed.

    python3 scripts/experiments/work_item_order.py

Orders, a causal row's latest blocks (the heaviest) first unless said:
- heads fastest, then blocks, then batch rows (the kernel's below 32k);
- KV head by KV head: the query heads of one KV head fastest, then blocks, then KV heads, then batch rows;
  its runs of blocks alternate their direction, the last run heaviest first (the kernel's from 32k);
- the same without alternating: every run heaviest first.
Sharing: CTA c takes items c, c + CTAs, ... ("strided"), or the c-th of a round then the c-th from the end of
the next ("mirrored", the kernel's).

The model misjudged one case on the GPU (c729dfe:docs/BENCHMARKS.md): heads fastest, mirrored, has the
smallest window here but ran the 131k forward slower than strided; KV head by KV head, mirrored, ran it faster
(docs/PERFORMANCE.md, "Attention"). What the model leaves out (each CTA's own pace, L2's two halves, Q and O
traffic) matters there.

The one-pass backward launches a CTA per (KV head, key block) instead, and the GPU starts each CTA in grid
order as one ends: the last table is that list scheduling's time over the ideal (total work / CTAs), with
the KV heads the grid's fastest axis (the kernel's) or the key blocks (kv_major_backward.patch at bf4cd01,
from 32k tokens: no faster on the GPU), a key block's work being the query tiles at and after it; one batch
row, one launch."""
from __future__ import annotations

import bisect
import heapq

Q_HEADS, GROUP, BLOCK_M = 32, 4, 128
KV_HEADS = Q_HEADS // GROUP
BLOCK_N, KV_BYTES_PER_KEY = 128, 2 * 128 * 2     # a key's K and V, D = 128, bf16


def heads_fastest(item: int, n_blocks: int, n_items: int) -> tuple[int, int]:
    """(KV head of a batch row, numbered across the rows; block's rank from the last block) of the item."""
    return item // (Q_HEADS * n_blocks) * KV_HEADS + item % Q_HEADS // GROUP, item // Q_HEADS % n_blocks


def kv_head_by_kv_head(item: int, n_blocks: int, n_items: int, alternate: bool = True) -> tuple[int, int]:
    rest = item // GROUP
    run = rest // n_blocks
    block = rest % n_blocks
    if alternate and (n_items // (GROUP * n_blocks) - 1 - run) % 2 == 1:
        block = n_blocks - 1 - block
    return run, block


def kv_head_by_kv_head_heaviest_first(item: int, n_blocks: int, n_items: int) -> tuple[int, int]:
    return kv_head_by_kv_head(item, n_blocks, n_items, alternate=False)


ORDERS = (heads_fastest, kv_head_by_kv_head, kv_head_by_kv_head_heaviest_first)


def cta_items(n_items: int, ctas: int, mirrored: bool) -> list[list[int]]:
    """Each CTA's items in the order it takes them."""
    items = [[] for _ in range(ctas)]
    for start in range(0, n_items, ctas):
        for cta in range(ctas):
            item = start + (ctas - 1 - cta if mirrored and start // ctas % 2 else cta)
            if item < n_items:
                items[cta].append(item)
    return items


def balance(order, seqlen: int, batch: int, ctas: int, mirrored: bool, samples: int = 200) -> tuple[float, ...]:
    """(most key tiles of a CTA / mean, KV heads (each batch row's its own) of a full round's items on
    average, mean window in MiB)."""
    n_blocks = -(-seqlen // BLOCK_M)
    n_items = batch * Q_HEADS * n_blocks
    items = [order(item, n_blocks, n_items) for item in range(n_items)]
    spans = []       # each CTA's (start, end, KV head) in tiles of time, one a key tile
    for mine in cta_items(n_items, ctas, mirrored):
        time, span = 0, []
        for kv, rank in (items[item] for item in mine):
            span.append((time, time + n_blocks - rank, kv))
            time += n_blocks - rank
        spans.append(span)
    loads = [span[-1][1] if span else 0 for span in spans]
    rounds = [{kv for kv, _ in items[start:start + ctas]} for start in range(0, n_items - ctas + 1, ctas)]
    windows = []
    for sample in range(1, samples):
        now, positions = max(loads) * sample / samples, {}
        for span in spans:
            at = bisect.bisect_right([start for start, _, _ in span], now) - 1
            if at >= 0 and now < span[at][1]:
                positions.setdefault(span[at][2], []).append(now - span[at][0])
        windows.append(sum(max(p) - min(p) + 1 for p in positions.values()) * BLOCK_N * KV_BYTES_PER_KEY / 2 ** 20)
    return max(loads) * ctas / sum(loads), sum(map(len, rounds)) / len(rounds), sum(windows) / len(windows)


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
            print(f"\n{ctas} CTAs, batch {batch}: most loaded CTA / mean, KV heads a round, window MiB")
            print("| tokens | " + " | ".join(f"{order.__name__}, {sharing}" for order in ORDERS
                                          for sharing in ("strided", "mirrored")) + " |\n" + "|---" * 7 + "|")
            for seqlen in LENGTHS:
                cells = (balance(order, seqlen, batch, ctas, mirrored) for order in ORDERS
                         for mirrored in (False, True))
                print(f"| {seqlen} | " + " | ".join(f"{most:.3f}, {kv:.1f}, {window:.0f}"
                                                    for most, kv, window in cells) + " |")
    print("\n| tokens | backward, 132 CTAs, KV heads fastest | key blocks fastest | 114 CTAs, KV heads fastest "
          "| key blocks fastest |\n|---|---|---|---|---|")
    for seqlen in LENGTHS:
        print(f"| {seqlen} | " + " | ".join(f"{backward_makespan(kv_first, seqlen, ctas):.3f}"
                                            for ctas in (132, 114) for kv_first in (True, False)) + " |")
