"""Does the Gluon forward's HBM traffic cost it speed at the power limit? The forward at 32k and 131k (B = 1,
32 query heads of 128, causal, bf16) with 8 KV heads (Llama-3 8B), 1 and 32: the same products, but K and V
read from HBM about 8 times less and 4 times more, when the persistent CTAs take work items heads fastest.
Timed in turn, metered (clock, power, work per joule over one-second cells).

    python3 scripts/experiments/forward_kv_traffic.py

What it found, and the order of work items built on it: docs/PERFORMANCE.md, "Attention"."""

import torch

from kernels.attention import flash_attention as fa, flash_attention_hopper as forward
from scripts import gpu_clocks
from experiment_timing import time_in_turn  # this script's folder

Q_HEADS, HEAD_DIM = 32, 128
fa.ensure_allocator(torch.device("cuda"))
with gpu_clocks.ClockSampler(gpu_clocks.current_gpu()) as sampler:
    for seqlen in (32768, 131072):
        q = torch.randn(1, seqlen, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        calls = {}
        for kv_heads in (8, 1, 32):
            k, v = (torch.randn(1, seqlen, kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in "kv")
            calls[f"{kv_heads} KV heads"] = (lambda k=k, v=v: forward.attention_forward(q, k, v, None, None, True,
                                                                                       0.1))
        for call in calls.values():     # compiled before timing (each KV head count is its own kernel)
            call()
        torch.cuda.synchronize()
        time_in_turn(f"{seqlen // 1024}k", calls, 2.0 * seqlen * seqlen * HEAD_DIM * Q_HEADS, 5, 1, sampler)
        q = k = v = calls = None  # free this size's tensors (closures above hold them)
