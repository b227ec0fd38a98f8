"""How far is FP8 attention (issue 48) from exact attention, beside bf16? The plain contract
(kernels.reference.fp8_attention: q, k, v and P in e4m3, block scales) with the Hadamard rotation off and on,
against fp32 attention of the same bf16 inputs: the output's relative error and dq, dk, dv's, causal, one long
document and packed documents, on random inputs and on inputs whose q and k carry a few large channels.

- bf16: kernels.reference.attention on the bf16 inputs (fp32 math, output and gradients stored in bf16; a bf16
  kernel also rounds P to bf16, which this does not);
- fp8, gradients "ste": autograd through the FP8 forward, each cast taken as the identity (an FP8 backward's
  target); "stats": the fp32-math backward from the FP8 forward's out and lse (kernels.reference.
  attention_backward, what a bf16 backward after an FP8 forward computes).

    python3 scripts/experiments/fp8_attention_error.py [--seqlen 8192] [--q-heads 4] [--kv-heads 1]

Runs on the GPU when there is one (the reference, not a kernel). Results: docs/PERFORMANCE.md, "Attention"."""

import argparse

import torch

from kernels import reference

# Packed rows: documents ending at these fractions of the row (a short one among them).
DOC_ENDS = (0.1, 0.35, 0.36, 0.8, 1.0)
OUTLIER_CHANNELS = 4


def relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return float((value.double() - exact.double()).norm() / exact.double().norm())


def inputs(kind: str, seqlen: int, q_heads: int, kv_heads: int, head_dim: int, device, generator):
    """q, k, v, dout in bf16: random, or with OUTLIER_CHANNELS channels of q and k 8 times larger (the same
    channels in both, as in real activations), q scaled down so the logits spread about as much as random ones."""
    def randn(heads):
        return torch.randn(1, seqlen, heads, head_dim, generator=generator).to(device)
    q, k, v, dout = randn(q_heads), randn(kv_heads), randn(kv_heads), randn(q_heads)
    if kind == "outliers":
        channels = torch.randperm(head_dim, generator=generator)[:OUTLIER_CHANNELS].to(device)
        q[..., channels] *= 8
        k[..., channels] *= 8
        q /= 4
    return tuple(t.bfloat16() for t in (q, k, v, dout))


def with_grads(attend, q, k, v, dout):
    """attend(q, k, v)'s output and (dq, dk, dv) through autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def per_document(cu_seqlens):
    """Attention of each document alone, concatenated: exact packed attention without an S x S mask."""
    def attend(q, k, v):
        bounds = cu_seqlens.tolist()
        return torch.cat([reference.attention(q[:, a:b], k[:, a:b], v[:, a:b], True)
                          for a, b in zip(bounds, bounds[1:])], dim=1)
    return attend


def study(kind: str, cu_seqlens, args, device) -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = inputs(kind, args.seqlen, args.q_heads, args.kv_heads, args.head_dim, device, generator)
    exact_attention = per_document(cu_seqlens) if cu_seqlens is not None else reference.attention
    exact_out, exact_grads = with_grads(exact_attention, *(t.float() for t in (q, k, v, dout)))
    rows = {"bf16": with_grads(exact_attention, q, k, v, dout)}
    for rotate in (False, True):
        name = f"fp8 rotate={'on' if rotate else 'off'}"
        out, grads = with_grads(lambda q, k, v: reference.fp8_attention(q, k, v, True, cu_seqlens, rotate=rotate),
                                q, k, v, dout)
        rows[f"{name} ste"] = out, grads
        with torch.no_grad():
            out, lse = reference.fp8_attention(q, k, v, True, cu_seqlens, rotate=rotate, return_lse=True)
        rows[f"{name} stats"] = out, reference.attention_backward(q, k, v, out, lse, dout, True, cu_seqlens)
    layout = "packed" if cu_seqlens is not None else "one document"
    for name, (out, grads) in rows.items():
        errors = [relative_error(out, exact_out)] + [relative_error(g, e) for g, e in zip(grads, exact_grads)]
        print(f"{args.seqlen:>7} {layout:<12} {kind:<8} {name:<20} " + " ".join(f"{e:8.2%}" for e in errors),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--q-heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ends = [0] + [round(f * args.seqlen) for f in DOC_ENDS]
    packed = torch.tensor(ends, dtype=torch.int32, device=device)
    print(f"causal, B=1, {args.q_heads}/{args.kv_heads} heads, D={args.head_dim}, {device}; packed: "
          f"documents ending at {ends[1:]}; relative error against fp32 of out, dq, dk, dv")
    for cu_seqlens in (None, packed):
        for kind in ("random", "outliers"):
            study(kind, cu_seqlens, args, device)


if __name__ == "__main__":
    main()
