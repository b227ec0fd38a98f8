"""Benchmarks of the norm, RoPE, SwiGLU and linear-cross-entropy kernels against their peers on one CUDA GPU
(results: docs/PERFORMANCE.md, "Kernels").

    python scripts/bench_kernels.py [--skip-liger] [--sweep] [--only norms|rope_swiglu|cross_entropy]

Norms: forward+backward on [65536, 4096] bf16 against torch eager, torch.compile and Liger-Kernel.
RoPE (q [1, 32768, 32, 128], k [1, 32768, 8, 128], Llama-3.1 tables) and SwiGLU ([32768, 14336]): forward+
backward in bf16 against the PyTorch ops the model ran before them, torch.compile of those, and Liger.
Linear cross-entropy: forward+backward at N=16384 and N=131072 (H=4096, V=128256, bf16) against Liger's
fused linear cross-entropy (and plain matmul + F.cross_entropy where it fits), with time and the peak
memory above the inputs, reported with and without the outputs (grad_hidden, grad_weight).
Times are medians of CUDA-event timings (triton.testing.do_bench) on random data.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from kernels.layer_norm_triton import layer_norm
from kernels.linear_cross_entropy_triton import (DEFAULT_MEMORY_BUDGET, cross_entropy_rows,
                                          linear_cross_entropy, plan_chunks)
from kernels.rms_norm_triton import rms_norm
from kernels.rope_triton import rope
from kernels.swiglu_triton import swiglu
from model.config import DecoderConfig
from model.rope import rope_tables
from offload.units import GIB
from trainer.metrics import MEASURED_MATMUL_TFLOPS

MATMUL_PEAK_TFLOPS = MEASURED_MATMUL_TFLOPS["h100_80gb"]  # the loss's floor: its matmuls at the H100's measured rate


def time_fwd_bwd(fn, inputs: list[torch.Tensor], dy: torch.Tensor) -> float:
    """Median ms of fn(*inputs).backward(dy), gradients reset between runs."""
    return do_bench(lambda: fn(*inputs).backward(dy), grad_to_none=inputs, warmup=100, rep=500,
                    return_mode="median")


def norm_inputs(rows: int, hidden: int, with_bias: bool):
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    params = [torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)]
    if with_bias:
        params.append(torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    return [x, *params], torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)


def bench_norms(skip_liger: bool) -> None:
    rows, hidden = 65536, 4096
    # bytes the fwd+bwd must move at least: fwd reads x, writes y; bwd reads x, dy, writes dx (2 B each).
    floor_bytes = 5 * rows * hidden * 2
    for name, ours, eager, with_bias in (
            ("rms_norm", lambda x, w: rms_norm(x, w, 1e-5), lambda x, w: F.rms_norm(x, (hidden,), w, 1e-5), False),
            ("layer_norm", lambda x, w, b: layer_norm(x, w, b, 1e-5),
             lambda x, w, b: F.layer_norm(x, (hidden,), w, b, 1e-5), True)):
        inputs, dy = norm_inputs(rows, hidden, with_bias)
        results = {"ours (Triton)": time_fwd_bwd(ours, inputs, dy),
                   "torch eager": time_fwd_bwd(eager, inputs, dy),
                   "torch.compile": time_fwd_bwd(torch.compile(eager), inputs, dy)}
        if not skip_liger:
            if name == "rms_norm":
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction
                results["Liger"] = time_fwd_bwd(lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5), inputs, dy)
            else:
                from liger_kernel.ops.layer_norm import LigerLayerNormFunction
                results["Liger"] = time_fwd_bwd(lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5),
                                                inputs, dy)
        y = ours(*inputs)
        forward_ms = do_bench(lambda: ours(*inputs), warmup=100, rep=500, return_mode="median")
        backward_ms = do_bench(lambda: y.backward(dy, retain_graph=True), grad_to_none=inputs, warmup=100,
                               rep=500, return_mode="median")
        print(f"\n{name} forward+backward [{rows}, {hidden}] bf16 (floor {floor_bytes / 1e9:.2f} GB moved)")
        for peer, ms in results.items():
            print(f"  {peer:<16} {ms:7.3f} ms  {floor_bytes / ms / 1e9:6.2f} TB/s effective")
        print(f"  ours split: forward {forward_ms:.3f} ms, backward {backward_ms:.3f} ms")
        inputs = dy = y = None  # free this size's tensors (closures above hold them)
        torch.cuda.empty_cache()


def time_fwd_bwd_pair(fn, inputs: list[torch.Tensor], grads: tuple[torch.Tensor, torch.Tensor]) -> float:
    """time_fwd_bwd for an op with two outputs (q and k)."""
    return do_bench(lambda: torch.autograd.backward(fn(*inputs), grads), grad_to_none=inputs, warmup=50,
                    rep=300, return_mode="median")


def torch_rope(q, k, cos, sin):
    """The PyTorch ops the model ran before kernels.rope (transformers' apply_rotary_pos_emb)."""
    def rotate(x):
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin
    return rotate(q), rotate(k)


def bench_rope_swiglu(skip_liger: bool) -> None:
    tokens, q_heads, kv_heads, head_dim, intermediate = 32768, 32, 8, 128, 14336
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    cfg = DecoderConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cos, sin = rope_tables(cfg, torch.arange(tokens, device="cuda")[None], torch.bfloat16)
    q = torch.randn(1, tokens, q_heads, head_dim, **bf16, requires_grad=True)
    k = torch.randn(1, tokens, kv_heads, head_dim, **bf16, requires_grad=True)
    grads = (torch.randn_like(q), torch.randn_like(k))
    # fwd reads q, k and writes them rotated; bwd reads and writes their gradients (2 B each; tables aside).
    rope_bytes = 4 * (q.numel() + k.numel()) * 2
    results = {"rope": {"ours (Triton)": time_fwd_bwd_pair(lambda q, k: rope(q, k, cos, sin), [q, k], grads),
                        "torch eager": time_fwd_bwd_pair(lambda q, k: torch_rope(q, k, cos, sin), [q, k], grads),
                        "torch.compile": time_fwd_bwd_pair(torch.compile(lambda q, k: torch_rope(q, k, cos, sin)),
                                                           [q, k], grads)}}
    if not skip_liger:
        from liger_kernel.ops.rope import LigerRopeFunction
        # Liger takes [B, H, S, D] views of [B, S, H, D] memory (transformers' layout) and rotates in place.
        liger_grads = tuple(g.transpose(1, 2) for g in grads)
        results["rope"]["Liger"] = time_fwd_bwd_pair(
            lambda q, k: LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin), [q, k],
            liger_grads)
    del q, k, grads
    gate = torch.randn(tokens, intermediate, **bf16, requires_grad=True)
    up = torch.randn(tokens, intermediate, **bf16, requires_grad=True)
    dy = torch.randn_like(gate)
    # fwd reads gate, up, writes y; bwd reads dy, gate, up, writes both gradients.
    swiglu_bytes = 8 * gate.numel() * 2
    eager = lambda g, u: F.silu(g) * u   # noqa: E731
    results["swiglu"] = {"ours (Triton)": time_fwd_bwd(swiglu, [gate, up], dy),
                         "torch eager": time_fwd_bwd(eager, [gate, up], dy),
                         "torch.compile": time_fwd_bwd(torch.compile(eager), [gate, up], dy)}
    if not skip_liger:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        results["swiglu"]["Liger"] = time_fwd_bwd(LigerSiLUMulFunction.apply, [gate, up], dy)
    del gate, up, dy
    torch.cuda.empty_cache()
    print(f"\nRoPE q [1, {tokens}, {q_heads}, {head_dim}] + k [1, {tokens}, {kv_heads}, {head_dim}] and SwiGLU "
          f"[{tokens}, {intermediate}], bf16, forward+backward ms (TB/s over the bytes each must move)")
    peers = list(results["swiglu"])
    print(f"  | op | {' | '.join(peers)} |\n  |---|{'---|' * len(peers)}")
    for op, floor in (("rope", rope_bytes), ("swiglu", swiglu_bytes)):
        cells = [f"{results[op][peer]:.3f} ({floor / results[op][peer] / 1e9:.2f})" for peer in peers]
        print(f"  | {op} | {' | '.join(cells)} |")


def sweep_swiglu_configs() -> None:
    """SwiGLU fwd+bwd time over columns per program and warps (picks the defaults)."""
    gate, up = (torch.randn(32768, 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "gu")
    dy = torch.randn_like(gate)
    print("\nswiglu sweep on [32768, 14336] bf16: block x num_warps -> fwd+bwd ms")
    for block, num_warps in ((512, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)):
        ms = time_fwd_bwd(lambda g, u: swiglu(g, u, block=block, num_warps=num_warps), [gate, up], dy)
        print(f"  block={block:<5} warps={num_warps:<3} {ms:.3f} ms")
    del gate, up, dy
    torch.cuda.empty_cache()


def sweep_norm_configs() -> None:
    """RMSNorm fwd+bwd time over warps per row and backward programs per SM (picks the defaults)."""
    inputs, dy = norm_inputs(65536, 4096, False)
    print("\nrms_norm sweep: num_warps x backward programs/SM -> fwd+bwd ms")
    for num_warps in (4, 8, 16):
        for programs in (2, 4, 8, 16):
            ms = time_fwd_bwd(lambda x, w: rms_norm(x, w, 1e-5, num_warps=num_warps,
                                                     backward_programs_per_sm=programs), inputs, dy)
            print(f"  warps={num_warps:<3} programs/SM={programs:<3} {ms:.3f} ms")


def sweep_cross_entropy_kernel() -> None:
    """The in-place loss/gradient kernel alone on one [8192, 128256] bf16 chunk, per block and warps."""
    logits = torch.randn(8192, 128256, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, 128256, (8192,), device="cuda")
    losses = torch.empty(8192, device="cuda")
    scale = torch.ones((), device="cuda")
    floor_bytes = 3 * logits.numel() * 2  # read twice (logsumexp, gradient), write once
    print("\ncross-entropy rows kernel sweep on [8192, 128256] bf16 (3 passes of bytes)")
    for block_v, num_warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)):
        ms = do_bench(lambda: cross_entropy_rows(logits, targets, losses, scale, -100, True, block_v=block_v,
                                                 num_warps=num_warps),
                      warmup=50, rep=300, return_mode="median")
        print(f"  BLOCK_V={block_v:<6} warps={num_warps:<3} {ms:.3f} ms  {floor_bytes / ms / 1e9:.2f} TB/s")
    logits = None  # free this size's tensors (closures above hold them)


def measure_loss(fn, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, repeats: int):
    """(median ms, peak GiB above the inputs, that peak less the outputs) of loss(fn).backward()."""
    times = []
    peak = 0
    for attempt in range(repeats + 1):  # the first run compiles and warms up
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(hidden, weight, targets).backward()
        end.record()
        torch.cuda.synchronize()
        if attempt:
            times.append(start.elapsed_time(end))
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
    outputs = hidden.grad.numel() * hidden.grad.element_size() + weight.grad.numel() * weight.grad.element_size()
    hidden.grad = weight.grad = None
    return statistics.median(times), peak / GIB, (peak - outputs) / GIB


def bench_linear_cross_entropy(skip_liger: bool) -> None:
    hidden_size, vocab = 4096, 128256
    for n_tokens in (16384, 131072):
        torch.manual_seed(0)
        hidden = torch.randn(n_tokens, hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = (0.02 * torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16)).requires_grad_()
        targets = torch.randint(0, vocab, (n_tokens,), device="cuda")
        repeats = 3 if n_tokens > 16384 else 5
        peers = {"ours (Triton)": linear_cross_entropy}
        if not skip_liger:
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
            peers["Liger"] = lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(h, w, t)[0]
        if n_tokens <= 16384:
            peers["matmul + F.cross_entropy"] = lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t)
        chunk, accumulate_fp32 = plan_chunks(n_tokens, hidden_size, vocab, torch.bfloat16, True,
                                             DEFAULT_MEMORY_BUDGET)
        matmul_floor_ms = 3 * 2 * n_tokens * hidden_size * vocab / (MATMUL_PEAK_TFLOPS * 1e12) * 1e3
        print(f"\nlinear_cross_entropy fwd+bwd N={n_tokens} H={hidden_size} V={vocab} bf16 "
              f"(ours: chunk {chunk} tokens, fp32 grad_weight accumulator: {accumulate_fp32}); "
              f"three matmuls at {MATMUL_PEAK_TFLOPS:.0f} TFLOP/s: {matmul_floor_ms:.1f} ms")
        for name, fn in peers.items():
            ms, peak, beyond_outputs = measure_loss(fn, hidden, weight, targets, repeats)
            print(f"  {name:<26} {ms:8.1f} ms  ({ms / matmul_floor_ms:.2f}x floor)  extra peak {peak:.2f} GiB "
                  f"(beyond outputs {beyond_outputs:.2f} GiB)")
        logits = torch.randn(chunk, vocab, device="cuda", dtype=torch.bfloat16)
        grad_hidden = torch.empty(chunk, hidden_size, device="cuda", dtype=torch.bfloat16)
        grad_weight = torch.zeros_like(weight)
        part = hidden[:chunk].detach()
        w = weight.detach()

        flops = 2 * chunk * hidden_size * vocab
        matmuls = {"logits = h @ W.T": lambda: torch.mm(part, w.t(), out=logits),
                   "grad_hidden = dlogits @ W": lambda: torch.mm(logits, w, out=grad_hidden),
                   "grad_weight += dlogits.T @ h": lambda: grad_weight.addmm_(logits.t(), part)}
        total_ms = 0.0
        for name, matmul in matmuls.items():
            ms = do_bench(matmul, warmup=20, rep=200, return_mode="median")
            total_ms += ms * n_tokens / chunk
            print(f"  cuBLAS {name:<30} {ms:6.2f} ms per {chunk}-token chunk ({flops / ms / 1e9:.0f} TFLOP/s)")
        print(f"  the three cuBLAS matmuls alone, scaled to N: {total_ms:.1f} ms "
              f"({3 * 2 * n_tokens * hidden_size * vocab / total_ms / 1e9:.0f} TFLOP/s)")
        # free this size's tensors (the closures above hold them)
        hidden = weight = targets = logits = grad_hidden = grad_weight = part = w = None
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-liger", action="store_true", help="run without liger_kernel installed")
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernels' launch configurations")
    parser.add_argument("--only", choices=("norms", "rope_swiglu", "cross_entropy"), help="run one section")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.only in (None, "norms"):
        bench_norms(args.skip_liger)
        if args.sweep:
            sweep_norm_configs()
    if args.only in (None, "rope_swiglu"):
        bench_rope_swiglu(args.skip_liger)
        if args.sweep:
            sweep_swiglu_configs()
    if args.only in (None, "cross_entropy"):
        if args.sweep:
            sweep_cross_entropy_kernel()
        bench_linear_cross_entropy(args.skip_liger)


if __name__ == "__main__":
    main()
