"""Is cuDNN's attention backward slower after our Gluon forward than after cuDNN's own? On a Hopper GPU, at
one length (32k by default; B = 1, 32/8 heads of 128, causal, bf16), in turn over rounds: the backward alone
given each forward's output and statistics, then forward+backward through SDPA-cuDNN and through
kernels.cudnn_attention (what kernels=auto runs). On 2026-11-25 the backward alone took the same time from
either forward, and forward+backward differed by under 1% here against 3-4% in bench_attention.py
(docs/BENCHMARKS.md).

    python3 docs/experiments/cudnn_backward_after_our_forward.py [SEQLEN] [ROUNDS]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import cudnn_attention  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SCALE = HEAD_DIM ** -0.5


def heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def main() -> None:
    seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    make = lambda heads: torch.randn(1, seqlen, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v, grad_out = make(Q_HEADS), make(KV_HEADS), make(KV_HEADS), make(Q_HEADS)
    theirs = torch.ops.aten._scaled_dot_product_cudnn_attention(heads_first(q), heads_first(k), heads_first(v),
                                                                None, True, 0.0, True, False, scale=SCALE)
    their_out, their_stats = heads_first(theirs[0]), theirs[1]
    our_out, our_stats = cudnn_attention._forward(q, k, v, True, SCALE)
    no_dropout = torch.empty((), dtype=torch.int64, device="cuda")

    def backward(out, stats):
        return lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            heads_first(grad_out), heads_first(q), heads_first(k), heads_first(v), heads_first(out), stats,
            no_dropout, no_dropout, None, None, None, seqlen, seqlen, 0.0, True, scale=SCALE)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def sdpa_cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*(heads_first(t) for t in leaves), is_causal=True, enable_gqa=True)
        torch.autograd.grad(heads_first(out), leaves, grad_out)

    def auto():
        torch.autograd.grad(cudnn_attention.cudnn_attention(*leaves), leaves, grad_out)

    cases = {"backward after cuDNN's forward": backward(their_out, their_stats),
             "backward after our forward": backward(our_out, our_stats),
             "sdpa cuDNN forward+backward": sdpa_cudnn,
             "auto forward+backward": auto}
    times = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in cases.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / 3)
    for name, runs in times.items():
        print(f"S={seqlen} {name:32s} median {statistics.median(runs):8.2f} ms  min {min(runs):8.2f}  "
              f"max {max(runs):8.2f}")


if __name__ == "__main__":
    main()
