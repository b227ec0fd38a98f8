"""The tile-level arithmetic of causal / packed-document flash attention: which key (or query) tiles a block
of tokens pairs with, split in masked and unmasked runs; each token's document bounds; which pairs of a
tile attend; one online-softmax step. Shared by the Triton kernels (triton_kernels.py) and,
recompiled as Gluon, by the Hopper forward and backward (flash_attention_hopper*.py)."""
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
    if not KEYS:
        # A key block crossing the sequence's end holds TMA's zero rows past it: unmasked, their scores 0 give
        # P = exp2(-lse), which overflows where every visible logit is very negative, and dQ = dS K gets inf * 0.
        # Every query tile of such a block is masked (in the Triton dK/dV kernel too, which computes no dQ and
        # does not need it, for one block per row).
        full_lo = tl.where(start + BLOCK > seqlen, hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def token_documents(DOC_START, DOC_END, tokens, valid, HAS_DOCS: tl.constexpr):
    """Each token's document bounds [start, end) (0 where not `valid`); without documents, the tokens
    themselves: placeholders that visible_pairs ignores."""
    doc_lo = tokens
    doc_hi = tokens
    if HAS_DOCS:
        doc_lo = tl.load(DOC_START + tokens, mask=valid, other=0)
        doc_hi = tl.load(DOC_END + tokens, mask=valid, other=0)
    return doc_lo, doc_hi


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


@triton.jit
def visible_pairs(query, key, doc_lo, doc_hi, other, seqlen, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Mask of query/key pairs that attend: `other` (the key, or the query) must lie in the document
    [doc_lo, doc_hi) of the opposite side, both inside the sequence, and key <= query when causal."""
    visible = (query < seqlen) & (key < seqlen)
    if CAUSAL:
        visible = visible & (key <= query)
    if HAS_DOCS:
        visible = visible & (other >= doc_lo) & (other < doc_hi)
    return visible


@triton.jit
def online_softmax(scores, m_i, l_i, qk_scale_log2, MASKED: tl.constexpr):
    """One online-softmax step in log2 units over a tile of scores: its probabilities (unnormalized), the
    rescale factor of what came before, and the new running max and sum."""
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale_log2)
    if MASKED:
        # A row with nothing visible yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(scores * qk_scale_log2 - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i
