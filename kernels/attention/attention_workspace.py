"""How the attention backwards bound the memory they need beyond their inputs and gradients: they run over
groups of KV heads, each with its query heads (a KV head's gradients come only from its own query heads, so
each group's results are final). Free of Triton, as kernels.attention.cudnn_attention (imported by the memory
planner) must be. The one-pass backward runs only under plans made for cuDNN's backward, and only where its
accumulator fits the cuDNN workspace they counted (kernels.attention.route.one_pass_fits_cudnn_plan): with
4 bytes per query element against cuDNN's 8 under the same cap it does whenever the KV heads are a power
of two (Llama-3: 8), not always otherwise."""
from __future__ import annotations

# The one-pass Gluon backward's (flash_attention_hopper_backward.py) fp32 dQ accumulator, per call at most:
# 131k tokens of 32 heads of 128 in one call.
ONE_PASS_MAX_BYTES = 4 * 2**30
ONE_PASS_BYTES_PER_QUERY_ELEMENT = 4


def fewest_head_groups(whole_bytes: int, kv_heads: int, max_bytes: int) -> int:
    """The fewest groups of KV heads, dividing them, whose share of a workspace of `whole_bytes` (for all
    heads) is within `max_bytes`; one KV head per group at most."""
    return next((groups for groups in range(1, kv_heads) if kv_heads % groups == 0
                 and whole_bytes <= groups * max_bytes), kv_heads)


def one_pass_head_groups(tokens: int, q_heads: int, kv_heads: int, head_dim: int) -> int:
    """How many calls the one-pass backward makes."""
    whole = ONE_PASS_BYTES_PER_QUERY_ELEMENT * tokens * q_heads * head_dim
    return fewest_head_groups(whole, kv_heads, ONE_PASS_MAX_BYTES)


def one_pass_workspace_bytes(tokens: int, q_heads: int, kv_heads: int, head_dim: int) -> int:
    """One call's accumulator of the one-pass backward."""
    whole = ONE_PASS_BYTES_PER_QUERY_ELEMENT * tokens * q_heads * head_dim
    return whole // one_pass_head_groups(tokens, q_heads, kv_heads, head_dim)
