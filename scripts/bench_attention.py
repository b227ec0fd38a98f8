"""Benchmark our attention (kernels.attention.route.flash_attention) against PyTorch's attention backends on one GPU.

Causal, B=1, 32 query heads, 8 KV heads, D=128, bf16, side by side in one run with
scaled_dot_product_attention(enable_gqa=True) under FLASH_ATTENTION and CUDNN_ATTENTION, and
torch.compile(flex_attention) with a causal block mask; and kernels.attention.cudnn_attention (cuDNN's backward
through the aten ops after our forward, which kernels=auto runs on Hopper). On Hopper "ours" and "auto"
share the forward: kernels/attention/flash_attention_hopper.py (Gluon, warp-specialized) for 16-bit inputs; "ours"
has the one-pass Gluon backward there (kernels/attention/flash_attention_hopper_backward.py; deterministic=True
would run the Triton two-kernel one). TFLOP/s
count causal FLOPs: forward 2*S^2*D per head, backward 2.5x that. Then the packed case: a pack of 16
documents of 4k tokens against 16 separate 4k calls and against FlexAttention with a document-causal block
mask, and against ours and cuDNN's (with --peers cudnn) on the documents as a batch of equal rows.

    python scripts/bench_attention.py [--seqlens 8192 32768 65536 131072] [--peers cudnn] [--deterministic]

Each length first times our first forward+backward call: autotuning and compiling, unless the tuning cache
(kernels/attention/tuning_cache.py, $LONGCTX_TUNING_CACHE) and Triton's compile cache already hold them.
TRITON_OVERRIDE_ARCH=sm80 times the code an A100 compiles, on this GPU.

The contenders of a case are timed in turn, round after round (`--rounds`, 5 by default), and each cell is
the median over the rounds with its spread (max - min, in % of the median): the GPU's clock moves with its
temperature and power, so one contender timed after another, once, is not a comparison
(docs/PERFORMANCE.md, "How to measure").
`--profile` adds, per case, the GPU time of each kernel of every contender's forward+backward (torch.profiler);
`--clocks`, the mean SM clock, the mean power by the energy counter and the work per joule (TFLOP/J) while each
cell was timed (NVML, scripts/gpu_clocks.py): at the GPU's power limit the work per joule decides speed. The
energy counter moves in steps too coarse for cells of do_bench's default 0.1 s: give `--rep-ms 1000` with it.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from conf.capability import gpu_capability
from kernels.attention import flash_attention as fa
from kernels.attention.route import AttentionRoute, attention, flash_attention
from scripts import gpu_clocks, step_profile

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
compiled_flex = torch.compile(flex_attention)


def causal_flops(doc_lengths: list[int], backward: bool) -> float:
    forward = sum(2.0 * n * n * HEAD_DIM * Q_HEADS for n in doc_lengths)
    return forward * (3.5 if backward else 1.0)


def make_inputs(seqlen: int):
    make = lambda heads: torch.randn(1, seqlen, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                                     requires_grad=True)
    return make(Q_HEADS), make(KV_HEADS), make(KV_HEADS)


def sdpa(backend):
    def run(q, k, v):  # SDPA wants [B, H, S, D]; the transposes are views
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)
    return run


def flex(block_mask):
    def run(q, k, v):
        out = compiled_flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                            enable_gqa=True)
        return out.transpose(1, 2)
    return run


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def step_fn(fn, q, k, v, backward: bool):
    """One call to time: the forward alone (no autograd), or forward and backward."""
    if not backward:
        def forward():
            with torch.no_grad():
                fn(q, k, v)
        return forward
    grad_out = torch.randn_like(q)
    return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)


def measure(contenders, inputs, doc_lengths, results, rounds: int, clocks=None, rep_ms: int = 100) -> list:
    """Time every contender's forward and forward+backward once per round, in turn, and report the median
    over the rounds with its spread (and, with a gpu_clocks.ClockSampler, the clock and power while it was
    timed). contenders: [(name, fn)]; a backend that refuses this shape is reported, not fatal. Returns the
    contenders whose forward+backward ran."""
    times = {(name, backward): [] for name, _ in contenders for backward in (False, True)}
    windows = {key: [] for key in times}
    for round_ in range(rounds):
        for name, fn in contenders:
            for backward in (False, True):
                if times[name, backward] is None:
                    continue
                try:
                    step = step_fn(fn, *inputs, backward)
                    if round_ == 0:     # tuning and compiling stay out of the cell's clock and power window
                        step()
                        torch.cuda.synchronize()
                    start = time.monotonic()
                    times[name, backward].append(triton.testing.do_bench(step, warmup=25, rep=rep_ms,
                                                                         return_mode="median"))
                    windows[name, backward].append((start, time.monotonic()))
                except Exception as error:
                    times[name, backward] = None
                    print(f"  {name}, round {round_ + 1}: {type(error).__name__}: {str(error)[:200]}", flush=True)
    for name, _ in contenders:
        row = {}
        for backward in (False, True):
            runs = times[name, backward]
            if runs:
                ms = statistics.median(runs)
                row["fwd+bwd" if backward else "fwd"] = (ms, causal_flops(doc_lengths, backward) / ms / 1e9,
                                                         100 * (max(runs) - min(runs)) / ms,
                                                         clocks.during(windows[name, backward]) if clocks else None)
            else:
                row["fwd+bwd" if backward else "fwd"] = None
        results.append((name, row))
        cells = [f"{k} {v[0]:8.2f} ms {v[1]:6.0f} TFLOP/s ±{v[2]:.1f}%{_clock_note(v[3], clocks, v[1])}" if v
                 else f"{k} failed" for k, v in row.items()]
        print(f"  {name:<28}" + " | ".join(cells), flush=True)
    return [(name, fn) for name, fn in contenders if times[name, True]]


def _clock_note(clock, clocks, tflops: float) -> str:
    """gpu_clocks.describe of a cell timed under a sampler; "" without one."""
    return gpu_clocks.describe(clock, tflops) if clocks is not None else ""


def profile_kernels(name: str, fn, inputs, steps: int = 3) -> None:
    """GPU time of each kernel of `steps` forward+backward calls (after one unprofiled), per call."""
    from torch.profiler import ProfilerActivity, profile
    step = step_fn(fn, *inputs, backward=True)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted(step_profile.device_kernels(prof), key=lambda kernel: -kernel[1])
    total = sum(micros for _, micros in kernels)
    print(f"  profile of {name}, per forward+backward: {total / steps / 1e3:.2f} ms of kernels", flush=True)
    for kernel, micros in kernels:
        print(f"    {micros / steps / 1e3:8.3f} ms {100 * micros / total:5.1f}%  {kernel[:110]}", flush=True)


def first_call_seconds(q, k, v) -> float:
    """Wall time of our first forward+backward at this shape: tuning and compiling included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), torch.randn_like(q))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_causal(seqlen: int, peers: list[str], results, rounds: int, profile: bool, clocks=None,
                 rep_ms: int = 100, deterministic: bool = False):
    print(f"S={seqlen}", flush=True)
    inputs = make_inputs(seqlen)
    print(f"  first fwd+bwd call (tuning + compiling unless cached): {first_call_seconds(*inputs):.1f} s", flush=True)
    runs = {"flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION), "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
            # the block mask is built without a dense S x S mask
            "flex": lambda: flex(create_block_mask(causal_mask, None, None, seqlen, seqlen, _compile=True))}
    names = {"flash": "sdpa FLASH_ATTENTION", "cudnn": "sdpa CUDNN_ATTENTION", "flex": "flex_attention compiled"}
    contenders = [(f"S={seqlen} flash_attention (ours)", lambda q, k, v: flash_attention(q, k, v, causal=True))]
    if deterministic:   # what `deterministic=true` costs: the Triton two-kernel backward
        contenders.append((f"S={seqlen} ours, deterministic",
                           lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=True)))
    if gpu_capability(inputs[0].device).cudnn_attention_backward:   # what kernels=auto runs on this GPU
        contenders.append((f"S={seqlen} cudnn_attention (auto)",
                           lambda q, k, v: attention(q, k, v, AttentionRoute("gluon", "cudnn"))))
    contenders += [(f"S={seqlen} {names[peer]}", runs[peer]()) for peer in peers]
    ran = measure(contenders, inputs, [seqlen], results, rounds, clocks, rep_ms)
    print("  tuned:", fa.tuned_configs(), flush=True)
    if profile:
        for name, fn in ran:
            profile_kernels(name, fn, inputs)


def as_batch(fn, num_docs: int):
    """fn on the pack's documents as a batch of rows (equal lengths): the same work in the form every kernel
    runs best, the yardstick of packed rows."""
    def run(q, k, v):
        rows = lambda t: t.view(num_docs, -1, *t.shape[2:])
        return fn(rows(q), rows(k), rows(v)).reshape(q.shape)
    return run


def bench_packed(num_docs: int, doc_len: int, peers: list[str], results, rounds: int, profile: bool,
                 clocks=None, rep_ms: int = 100):
    total = num_docs * doc_len
    print(f"packed: {num_docs} x {doc_len} documents in one {total}-token row", flush=True)
    inputs = make_inputs(total)
    cu_seqlens = torch.arange(0, total + 1, doc_len, device="cuda", dtype=torch.int32)
    doc_of = torch.arange(total, device="cuda") // doc_len

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_of[q_idx] == doc_of[kv_idx])

    def separate_calls(q, k, v):
        return torch.cat([flash_attention(q[:, s:s + doc_len], k[:, s:s + doc_len], v[:, s:s + doc_len])
                          for s in range(0, total, doc_len)], dim=1)
    block_mask = create_block_mask(document_causal, None, None, total, total, _compile=True)
    contenders = [("packed ours cu_seqlens", lambda q, k, v: flash_attention(q, k, v, cu_seqlens=cu_seqlens)),
                  (f"ours {num_docs} separate calls", separate_calls),
                  (f"ours as a batch of {num_docs}", as_batch(lambda q, k, v: flash_attention(q, k, v), num_docs))]
    if "cudnn" in peers:
        contenders.append((f"sdpa cuDNN as a batch of {num_docs}",
                           as_batch(sdpa(SDPBackend.CUDNN_ATTENTION), num_docs)))
    contenders.append(("packed flex doc-causal", flex(block_mask)))
    ran = measure(contenders, inputs, [doc_len] * num_docs, results, rounds, clocks, rep_ms)
    if profile:
        for name, fn in ran:
            profile_kernels(name, fn, inputs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="*", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--packed", type=int, nargs=2, default=[16, 4096], metavar=("DOCS", "LEN"))
    parser.add_argument("--peers", nargs="*", choices=["flash", "cudnn", "flex"], default=["flash", "cudnn", "flex"])
    parser.add_argument("--no-packed", action="store_true", help="skip the packed-documents case")
    parser.add_argument("--rounds", type=int, default=5, help="timings of each contender, taken in turn")
    # The energy counter moves in steps too coarse for 0.1 s cells: --clocks wants 1000+ (docs/PERFORMANCE.md).
    parser.add_argument("--rep-ms", type=int, default=100, help="milliseconds each timing of a cell lasts")
    parser.add_argument("--profile", action="store_true",
                        help="GPU time of each kernel of every contender's fwd+bwd")
    parser.add_argument("--clocks", action="store_true",
                        help="the SM clock and power draw while each cell was timed (NVML)")
    parser.add_argument("--deterministic", action="store_true",
                        help="also ours with deterministic=True (bit-identical gradients run to run)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.rep_ms < 1:
        parser.error(f"--rep-ms must be at least 1, got {args.rep_ms}")
    if args.clocks and not gpu_clocks.available():
        parser.error("--clocks needs NVML (libnvidia-ml.so.1, installed with the NVIDIA driver)")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    results = []
    sampler = gpu_clocks.ClockSampler(gpu_clocks.current_gpu()) if args.clocks else contextlib.nullcontext()
    with sampler as clocks:
        for seqlen in args.seqlens:
            bench_causal(seqlen, args.peers, results, args.rounds, args.profile, clocks, args.rep_ms,
                         args.deterministic)
            torch.cuda.empty_cache()
        if not args.no_packed:
            bench_packed(*args.packed, args.peers, results, args.rounds, args.profile, clocks, args.rep_ms)
    print(f"\n{args.rounds} rounds; each cell the median, ± the spread (max - min) in % of it")
    print("| case | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |\n|---|---|---|---|---|")
    for name, row in results:
        cells = [f"{row[k][0]:.2f} | {row[k][1]:.0f} ±{row[k][2]:.1f}%{_clock_note(row[k][3], clocks, row[k][1])}"
                 if row.get(k) else "failed | -" for k in ("fwd", "fwd+bwd")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
