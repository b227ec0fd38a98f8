"""Which key (or query) tiles a block of tokens pairs with in causal / packed-document attention, split in
masked and unmasked runs: shared by the Triton kernels (kernels/flash_attention.py) and, recompiled as
Gluon, by the Hopper forward (kernels/flash_attention_hopper.py)."""
import triton
import triton.language as tl


@triton.jit
def partner_range(DOC_START, DOC_END, start, seqlen, BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_DOCS: tl.constexpr, KEYS: tl.constexpr):
    """The partners of the block of tokens [start, start + BLOCK): its queries' keys (KEYS) or its keys'
    queries. All lie in [lo, hi); every token of the block pairs with all of [full_lo, full_hi)."""
    last = tl.minimum(start + BLOCK, seqlen) - 1
    if HAS_DOCS:
        # Document bounds are non-decreasing along the tokens: the first and last rows bound the block.
        lo = tl.load(DOC_START + start)
        full_lo = tl.load(DOC_START + last)
        full_hi = tl.load(DOC_END + start)
        hi = tl.load(DOC_END + last)
    else:
        lo = 0
        full_lo = 0
        full_hi = seqlen
        hi = seqlen
    if CAUSAL:
        if KEYS:  # a query sees the keys up to itself
            full_hi = tl.minimum(full_hi, start + 1)
            hi = tl.minimum(hi, last + 1)
        else:     # a key is seen by the queries from itself on
            lo = tl.maximum(lo, start)
            full_lo = tl.maximum(full_lo, last)
    return lo, full_lo, full_hi, hi


@triton.jit
def tile_runs(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """Split tiles of BLOCK starting at lo into a masked head run, an unmasked run inside
    [full_lo, full_hi) and a masked tail run up to hi; returns the three tile counts."""
    head = tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK)
    mid_start = lo + head * BLOCK
    mid = tl.maximum(full_hi - mid_start, 0) // BLOCK
    tail_start = mid_start + mid * BLOCK
    tail = tl.cdiv(tl.maximum(hi - tail_start, 0), BLOCK)
    return head, mid, tail
