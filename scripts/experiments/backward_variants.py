"""Time variants of the one-pass Gluon backward (kernels/attention/flash_attention_hopper_backward.py) against it, on
a Hopper GPU: each variant is the kernel's source with text replaced, written to a temporary module; every
replacement must match exactly once, so a variant that no longer fits the kernel fails at once. The
variants run in turn over rounds (the GPU's clock drifts), at 8k, 32k and packed 16 x 4k (B = 1, 32/8
heads of 128, causal, bf16); each is checked against the kernel as it is (dq differs by its atomics' order).

    python3 scripts/experiments/backward_variants.py [VARIANT ...] [--cases packed-16x4k batch-16x4k ...] [--meter]
    python3 scripts/experiments/backward_variants.py --base HEAD [VARIANT ...] [--cell-ms 1000]
        # the kernel file at a git revision (with that revision's forward module, the working tree's
        # others), the working tree's, and the named variants of the working tree's

`--meter` adds each timing's clock, mean power and work per joule (NVML), timings of a second each: at the
power limit work per joule is speed (docs/PERFORMANCE.md, "How to measure").

The variants below were measured none faster beyond the spread (docs/PERFORMANCE.md, "Tried and not kept");
a new idea is one more entry in VARIANTS. Times are of `attention_backward` (with its accumulator's zeroing and
cast, not the delta kernel)."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kernels.attention import flash_attention as fa, flash_attention_hopper as fh
from kernels.attention.function import document_bounds
from experiment_timing import time_in_turn  # this script's folder
from scripts import gpu_clocks

ROOT = Path(__file__).resolve().parents[2]
SOURCE = (ROOT / "kernels" / "attention" / "flash_attention_hopper_backward.py").read_text()
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SCALE = HEAD_DIM ** -0.5
# label: (batch rows, the documents' lengths in each row, document bounds given even for one document per row)
CASES = {"8k": (1, [8192], False), "32k": (1, [32768], False), "packed-16x4k": (1, [4096] * 16, True),
         # the packed case's work as a batch, without and with document bounds: what packing itself costs
         "batch-16x4k": (16, [4096], False), "batch-16x4k-bounds": (16, [4096], True), "64k": (1, [65536], False),
         "131k": (1, [131072], False)}
DEFAULT_CASES = ["8k", "32k", "packed-16x4k", "batch-16x4k", "batch-16x4k-bounds"]

# name: [(old, new), ...] applied to SOURCE in order. (Freeing dO's stage as soon as dV is done, measured
# before dO and Q shared one free barrier per stage, is gone with that barrier: c729dfe:docs/BENCHMARKS.md.)
VARIANTS = {
    # the softmax scale folded into P once P is stored for dV: dS carries it, dQ needs no multiply
    "scale_p": [
        ("            dp = warpgroup_mma_wait(1, deps=(dp, ))\n",
         "            p = p * sm_scale\n            dp = warpgroup_mma_wait(1, deps=(dp, ))\n"),
        ("            dq = dq * sm_scale\n", ""),
        ("k_smem.store((dk * sm_scale).to(dtype))", "k_smem.store(dk.to(dtype))"),
    ],
    # dQ accumulated token-major, [B, S, heads, D] as q is: the rows that the CTAs running together add to
    # (one document's, of every head) lie together, and the final cast is a plain copy
    "token_major_dq": [
        ("dq_row = dq_row0 + group_head * seqlen\n",
         "dq_row = dq_row0[0]\n        dq_col = (dq_row0[1] + group_head) * HEAD_DIM\n"),
        ("_tma_reduce_add(dq_desc, [(dq_row + start).to(gl.int32), 0], dq_smem)",
         "_tma_reduce_add(dq_desc, [(dq_row + start).to(gl.int32), dq_col.to(gl.int32)], dq_smem)"),
        ("shape=[gl.num_programs(2) * call_q_heads * seqlen, HEAD_DIM],\n"
         "                                         strides=[HEAD_DIM, 1],",
         "shape=[gl.num_programs(2) * seqlen, call_q_heads * HEAD_DIM],\n"
         "                                         strides=[call_q_heads * HEAD_DIM, 1],"),
        ("dq_row0 = (batch * call_q_heads + call_kv_head * GROUP) * seqlen",
         "dq_row0 = (batch * seqlen, call_kv_head * GROUP)"),
        ("torch.empty((batch, call_kv_heads * group, seqlen, head_dim)",
         "torch.empty((batch, seqlen, call_kv_heads * group, head_dim)"),
        ("dq[:, :, heads].copy_(dq_acc.transpose(1, 2))", "dq[:, :, heads].copy_(dq_acc)"),
    ],
    # the masked tiles' document test on the queries' bounds (2 rows a thread) instead of the keys' (16
    # columns), read for every step under a mask that is false outside the masked tiles, before S is waited for
    "query_docs": [
        ("            scores = warpgroup_mma_wait(1, deps=(scores, ))\n"
         "            if (tile < head_tiles) | (tile >= mid_end):\n",
         "            masked = (tile < head_tiles) | (tile >= mid_end)\n"
         "            query_doc_lo, query_doc_hi = _token_documents(DOC_START, DOC_END, queries, "
         "(queries < seqlen) & masked,\n"
         "                                                          HAS_DOCS)\n"
         "            scores = warpgroup_mma_wait(1, deps=(scores, ))\n"
         "            if masked:\n"),
        ("                key_doc_lo, key_doc_hi = _token_documents(DOC_START, DOC_END, keys, keys < seqlen, "
         "HAS_DOCS)\n"
         "                visible = _visible_pairs(queries[:, None], keys[None, :], key_doc_lo[None, :],\n"
         "                                         key_doc_hi[None, :], queries[:, None], seqlen, CAUSAL, HAS_DOCS)\n",
         "                visible = _visible_pairs(queries[:, None], keys[None, :], query_doc_lo[:, None],\n"
         "                                         query_doc_hi[:, None], keys[None, :], seqlen, CAUSAL, HAS_DOCS)\n"),
    ],
}


def variant_source(name: str) -> str:
    text = SOURCE
    for old, new in VARIANTS[name]:
        if text.count(old) != 1:
            raise SystemExit(f"variant {name}: {old.strip()!r} is not in the kernel exactly once")
        text = text.replace(old, new)
    return text


def load(name: str, text: str, folder: Path):
    path = folder / f"backward_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"backward_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_revision(rev: str, folder: Path):
    """The backward kernel file at a git revision, importing that revision's forward module (the helpers it
    takes from there change with it; the other modules are the working tree's)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    name = "kernels.attention.flash_attention_hopper"      # revisions since kernels/attention/ (issue 37)
    forward = load("forward_of_base", show("kernels/attention/flash_attention_hopper.py"), folder)
    tree_forward = sys.modules[name]
    sys.modules[name] = forward
    try:
        return load("base", show("kernels/attention/flash_attention_hopper_backward.py"), folder)
    finally:
        sys.modules[name] = tree_forward


def inputs(rows: int, lengths: list[int], with_bounds: bool):
    """q, k, v, dO, the forward's base-2 lse, delta and the document bounds of rows packed alike."""
    total = sum(lengths)
    generator = torch.Generator(device="cuda").manual_seed(0)
    make = lambda heads: torch.randn(rows, total, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                                     generator=generator)
    q, do, k, v = make(Q_HEADS), make(Q_HEADS), make(KV_HEADS), make(KV_HEADS)
    bounds = (None, None)
    if with_bounds:
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        bounds = document_bounds(cu_seqlens, total)
    out, lse = fh.attention_forward(q, k, v, *bounds, True, SCALE * fa.LOG2E)
    delta = (out.float() * do.float()).sum(-1).transpose(1, 2).contiguous()
    return do, q, k, v, lse, delta, *bounds


def backward_flops(rows: int, lengths: list[int]) -> float:
    return 2.5 * rows * sum(2.0 * n * n * HEAD_DIM * Q_HEADS for n in lengths)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_case(label: str, case: tuple, modules: dict, rounds: int, cell_ms: float, sampler=None) -> None:
    """Each module's backward against the first one's output, then all timed in turn, cells of about cell_ms."""
    args = inputs(*case)
    reps = max(1, round(cell_ms / (backward_flops(*case[:2]) / 5e11)))   # at about 500 TFLOP/s
    call = lambda module: module.attention_backward(*args, True, SCALE, SCALE * fa.LOG2E)
    first = next(iter(modules))
    base = call(modules[first])
    for name, module in modules.items():
        if name != first:
            print(f"{label} {name}: rel diff dq dk dv", [f"{rel_diff(a, b):.1e}" for a, b in zip(call(module), base)])
    time_in_turn(label, {name: (lambda module=module: call(module)) for name, module in modules.items()},
                 backward_flops(*case[:2]), rounds, reps, sampler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"of {', '.join(VARIANTS)}; all of them if none")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=DEFAULT_CASES)
    parser.add_argument("--base", metavar="REV", help="time the kernel file at this git revision against the working "
                        "tree's (and the variants named, if any)")
    parser.add_argument("--cell-ms", type=float, default=100.0, help="GPU time of one timing of a case")
    parser.add_argument("--meter", action="store_true", help="clock, power and TFLOP/J of each (NVML)")
    args = parser.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"no variant {sorted(unknown)}; there are {list(VARIANTS)}")
    fa.ensure_allocator(torch.device("cuda"))
    sampler = gpu_clocks.ClockSampler(gpu_clocks.current_gpu()) if args.meter else None
    with tempfile.TemporaryDirectory() as folder, sampler or contextlib.nullcontext():
        if args.base:
            modules = {args.base: load_revision(args.base, Path(folder)), "tree": load("tree", SOURCE, Path(folder))}
        else:
            modules = {"kernel": load("kernel", SOURCE, Path(folder))}
        named = args.variants or ([] if args.base else VARIANTS)
        modules.update({name: load(name, variant_source(name), Path(folder)) for name in named})
        for label in args.cases:
            run_case(label, CASES[label], modules, rounds=6 if label in ("32k", "64k", "131k") else 9,
                     cell_ms=args.cell_ms, sampler=sampler)


if __name__ == "__main__":
    main()
