"""cuDNN's attention for packed rows (torch's `aten::_cudnn_attention_forward/backward` with cum_seq_q and
cum_seq_k, [T, H, D] tensors, statistics [T, H, 1]) against a per-document fp32 reference and against ours,
on a Hopper GPU: output and gradient errors, and times. What it found on torch 2.11: docs/PERFORMANCE.md,
"Tried and not kept"; run it again on a newer torch before routing packed rows to cuDNN.

    python3 scripts/experiments/cudnn_packed_rows.py
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.attention import flash_attention as fa, flash_attention_hopper as fh
from kernels.attention.function import document_bounds
import experiment_timing  # this script's folder

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SCALE = HEAD_DIM ** -0.5
PACKS = {"16 x 4k": [4096] * 16, "64 x 1k": [1024] * 64, "4096 + 4001 + 95": [4096, 4001, 95]}


def reference(q, k, v, grad_out, lengths):
    """Per document, fp32 SDPA: output and gradients, concatenated along the tokens."""
    pieces, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[0, start:start + n].float().transpose(0, 1).requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True, enable_gqa=True,
                                             scale=SCALE)[0]
        out.backward(grad_out[0, start:start + n].float().transpose(0, 1))
        pieces.append([t.transpose(0, 1) for t in (out.detach(), qs.grad, ks.grad, vs.grad)])
        start += n
    return [torch.cat(parts)[None] for parts in zip(*pieces)]


def rel_err(ours, exact) -> float:
    return ((ours.float() - exact).norm() / exact.norm()).item()


def cudnn_forward(q, k, v, cu_seqlens, longest):
    result = torch.ops.aten._cudnn_attention_forward(q[0], k[0], v[0], None, cu_seqlens, cu_seqlens, longest,
                                                     longest, True, 0.0, True, False, scale=SCALE)
    return result[0], result[1]


def cudnn_backward(grad_out, q, k, v, out, stats, cu_seqlens, longest):
    no_dropout = torch.empty((), dtype=torch.int64, device="cuda")
    return torch.ops.aten._cudnn_attention_backward(grad_out[0], q[0], k[0], v[0], out, stats, no_dropout,
                                                    no_dropout, None, cu_seqlens, cu_seqlens, longest, longest,
                                                    0.0, True, scale=SCALE)


def milliseconds(fn, reps: int = 10) -> float:
    """After one warm-up call, experiment_timing.milliseconds."""
    fn()
    return experiment_timing.milliseconds(fn, reps)


def run_pack(label: str, lengths: list[int]) -> None:
    total = sum(lengths)
    make = lambda heads: torch.randn(1, total, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v, grad_out = make(Q_HEADS), make(KV_HEADS), make(KV_HEADS), make(Q_HEADS)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    exact = reference(q, k, v, grad_out, lengths)
    out, stats = cudnn_forward(q, k, v, cu_seqlens, longest)
    print(f"{label}: cuDNN forward error {rel_err(out[None], exact[0]):.2e}, statistics {tuple(stats.shape)}")
    grads = cudnn_backward(grad_out, q, k, v, out, stats, cu_seqlens, longest)
    print(f"{label}: cuDNN backward errors dq dk dv",
          [f"{rel_err(g[None], e):.2e}" for g, e in zip(grads, exact[1:])])
    bounds = document_bounds(cu_seqlens, total)
    ours = lambda: fh.attention_forward(q, k, v, *bounds, True, SCALE * fa.LOG2E)
    ours_out, lse_log2 = ours()
    ours_stats = (lse_log2[0] * math.log(2)).t().contiguous().unsqueeze(-1)     # cuDNN's [T, H, 1]
    grads = cudnn_backward(grad_out, q, k, v, ours_out[0], ours_stats, cu_seqlens, longest)
    print(f"{label}: our forward + cuDNN backward errors dq dk dv",
          [f"{rel_err(g[None], e):.2e}" for g, e in zip(grads, exact[1:])])
    print(f"{label}: forward ms ours {milliseconds(ours):.2f}, cuDNN "
          f"{milliseconds(lambda: cudnn_forward(q, k, v, cu_seqlens, longest)):.2f}; cuDNN backward ms "
          f"{milliseconds(lambda: cudnn_backward(grad_out, q, k, v, out, stats, cu_seqlens, longest)):.2f}",
          flush=True)


def main() -> None:
    print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    fa.ensure_allocator(torch.device("cuda"))
    for label, lengths in PACKS.items():
        run_pack(label, lengths)


if __name__ == "__main__":
    main()
