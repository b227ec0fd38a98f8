"""GPU time of one profiled training step, by kind of work, from the names of the kernels that ran.

`scripts/bench_train.py --profile` prints it. The kinds follow the kernels' names: cuBLAS matrix products,
our Triton kernels (attention, norms, the fused loss, AdamW), PyTorch's elementwise and reduction kernels
(RoPE, SwiGLU's product and activation, residual adds, LoRA scaling and dropout, casts), and copies
(the offload engine's host<->device transfers run on a side stream, overlapping compute, so their time is
not part of the step's critical path)."""
from __future__ import annotations

import re

# First match wins; the patterns are matched against the kernel name.
KERNEL_KINDS = (
    ("attention", r"_attn_|sdpa|fmha|flash|cudnn::fusion"),   # ours (Triton), cuDNN's and its helpers
    ("norms", r"_row_norm|rms_norm|layer_norm"),
    ("loss (linear cross-entropy)", r"cross_entropy|_lce_|logsumexp"),
    ("optimizer", r"adamw|multi_tensor|_foreach"),
    ("matrix products (cuBLAS)", r"gemm|nvjet|cutlass|xmma|sm90_|sm80_|splitK"),
    ("copies (offload, side stream)", r"^Memcpy (DtoH|HtoD)"),
    ("activation (SiLU)", r"silu"),
    ("casts and copies", r"copy_kernel|direct_copy|CatArrayBatchedCopy|to_copy|^Memcpy DtoD|^Memset"),
    ("reductions", r"reduce_kernel|norm_kernel|sum_kernel"),
    ("elementwise (RoPE, SwiGLU product, residuals, LoRA scaling)", r"elementwise|vectorized|unrolled"),
)


def kind_of(kernel_name: str) -> str:
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, kernel_name):
            return kind
    return "other"


def time_by_kind(kernels: list[tuple[str, float]]) -> dict[str, float]:
    """Milliseconds per kind, largest first, from (kernel name, device microseconds) pairs."""
    totals: dict[str, float] = {}
    for name, micros in kernels:
        kind = kind_of(name)
        totals[kind] = totals.get(kind, 0.0) + micros / 1e3
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def device_kernels(profiler) -> list[tuple[str, float]]:
    """(name, self device microseconds) of every GPU kernel and copy in a torch.profiler run."""
    from torch.autograd import DeviceType
    return [(row.key, row.self_device_time_total) for row in profiler.key_averages()
            if row.device_type == DeviceType.CUDA and row.self_device_time_total > 0]


def kind_table(totals: dict[str, float], step_ms: float) -> str:
    lines = [f"{'kind':<62}{'ms':>10}{'% of step':>11}"]
    lines += [f"{kind:<62}{ms:>10.1f}{100 * ms / step_ms:>10.1f}%" for kind, ms in totals.items()]
    compute = sum(ms for kind, ms in totals.items() if not kind.startswith("copies (offload"))
    lines.append(f"{'GPU idle on the compute stream (step - compute kernels)':<62}{step_ms - compute:>10.1f}"
                 f"{100 * (step_ms - compute) / step_ms:>10.1f}%")
    return "\n".join(lines)
