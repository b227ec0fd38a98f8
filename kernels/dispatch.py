"""Which implementation each op the model calls runs: a Triton kernel or `kernels.reference`.

Backends: "auto" (Triton where the tensor is on CUDA and a kernel exists for it, e.g. attention only for
the head dims and dtypes `flash_attention.supports`, else the reference; attention through cuDNN instead
where the memory plan chose it, `attention_kernels`), "triton" (Triton or a clear
error), "reference" (always the plain PyTorch ops). `TRITON_INTERPRET=1` lets "triton" run the kernels on
CPU tensors through Triton's interpreter (tests do this).

The Triton modules are imported on first use, not here: `import kernels` must work before the tests
choose interpreter or compiler (Triton decides when it is first imported) and on machines without Triton.
"""
from __future__ import annotations

import importlib

import torch

from conf.schema.job import check_kernels_backend
from kernels import reference

# The ops with a Triton twin; each lives in `kernels/<op>.py` as a function of the same name, except
# attention, whose kernel is `flash_attention`.
TRITON_OPS = {
    "rms_norm": ("kernels.rms_norm", "rms_norm"),
    "layer_norm": ("kernels.layer_norm", "layer_norm"),
    "linear_cross_entropy": ("kernels.linear_cross_entropy", "linear_cross_entropy"),
    "attention": ("kernels.flash_attention", "flash_attention"),
    "adamw_update": ("kernels.adamw_update", "adamw_update"),
    "rope": ("kernels.rope", "rope"),
    "swiglu": ("kernels.swiglu", "swiglu"),
}

# The attention kernels a memory plan can be made for: "flash" is kernels.flash_attention (the reference
# where it does not run), "cudnn" is kernels.cudnn_attention for the rows it takes, flash for the rest.
ATTENTION_KERNELS = ("flash", "cudnn")

_backend = "auto"
_attention_kernel = "flash"
_sequence_group = None        # a torch.distributed group when attention runs sequence-parallel
_deterministic = False        # attention's backward without atomics (the Triton two-kernel one)


def set_backend(name: str, attention_kernel: str = "flash", deterministic: bool = False) -> None:
    """Choose how ops dispatch; "triton" without CUDA is an error unless TRITON_INTERPRET=1.
    attention_kernel: one of `attention_kernels(...)`, the one the memory plan was made for.
    deterministic: gradients bit-identical run to run (flash_attention's backward without atomics)."""
    global _backend, _attention_kernel, _deterministic
    check_kernels_backend(name)
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel={attention_kernel!r} is not one of {ATTENTION_KERNELS}")
    _backend, _attention_kernel, _deterministic = name, attention_kernel, deterministic


def set_sequence_parallel(group) -> None:
    """Run attention Ulysses-style over `group` (kernels.sequence_parallel): each rank then holds a slice of
    the sequence, and cu_seqlens describe the whole one. None: this process holds whole sequences."""
    global _sequence_group
    _sequence_group = group


def attention_kernels(backend: str, deterministic: bool, device: torch.device,
                      planned_gpu_is_hopper: bool | None = None) -> tuple[str, ...]:
    """The attention kernels a job may run, fastest first, for the planner to try in turn: cuDNN's where
    it is available under "auto" (its backward adds dQ with atomics: not with deterministic=true), then
    ours. "triton" asks for our Triton kernels throughout. planned_gpu_is_hopper: planning for a GPU other
    than this machine's (scripts/plan.py memory.gpu=...), answer for that one."""
    from kernels import cudnn_attention
    if planned_gpu_is_hopper is None:
        cudnn_runs = cudnn_attention.available(device)
    else:
        cudnn_runs = device.type == "cuda" and planned_gpu_is_hopper
    if backend == "auto" and not deterministic and cudnn_runs:
        return ("cudnn", "flash")
    return ("flash",)


def get_backend() -> str:
    return _backend


def _triton_module(name: str):
    return importlib.import_module(TRITON_OPS[name][0])


def _triton_op(name: str):
    return getattr(_triton_module(name), TRITON_OPS[name][1])


def _pick(name: str, tensor: torch.Tensor):
    if _backend == "reference":
        return getattr(reference, name)
    if _backend == "triton" or tensor.is_cuda:
        return _triton_op(name)
    return getattr(reference, name)


def _triton_attention_runs(backend: str, device_type: str, head_dim: int, dtype: torch.dtype | None) -> bool:
    """The one answer to "does the Triton attention run here": not under "reference", and under "auto"
    only on CUDA; then where the kernel takes the head dim and dtype (None: any dtype it takes)."""
    if backend == "reference" or (backend == "auto" and device_type != "cuda"):
        return False
    return _triton_module("attention").supports(head_dim, dtype)


def attention_records(backend: str, device_type: str, head_dim: int) -> bool:
    """Whether attention under `backend` on `device_type` records on an AttentionTape: the Triton attention
    and cuDNN's (which runs only where the Triton one would, on CUDA under "auto") do, the reference does
    not, so keeping attention outputs helps only where they run. Asked before the model exists:
    its activations are fp32, fp16 or bf16, each a dtype the kernel takes, so the head dim decides."""
    return _triton_attention_runs(backend, device_type, head_dim, None)


def rms_norm(x, weight, eps):
    return _pick("rms_norm", x)(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    return _pick("layer_norm", x)(x, weight, bias, eps)


def rope(q, k, cos, sin):
    """New (q, k) rotated by the per-token tables (reference.rope), out of place on either backend."""
    return _pick("rope", q)(q, k, cos, sin)


def swiglu(gate, up):
    return _pick("swiglu", gate)(gate, up)


def attention(q, k, v, causal=True, cu_seqlens=None, softmax_scale=None):
    if _sequence_group is not None:
        from kernels.sequence_parallel import ulysses_attention
        return ulysses_attention(_attention_on_this_rank, q, k, v, _sequence_group, causal=causal,
                                 cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)
    return _attention_on_this_rank(q, k, v, causal, cu_seqlens, softmax_scale)


def _attention_on_this_rank(q, k, v, causal=True, cu_seqlens=None, softmax_scale=None):
    # Under "triton" a shape the kernel lacks still goes to it, whose checks name the problem; "auto"
    # falls back to the reference (e.g. the tiny model's head dim 16 on a GPU).
    if _attention_kernel == "cudnn" and q.is_cuda:
        cudnn = importlib.import_module("kernels.cudnn_attention")
        if cudnn.supports(q, k, cu_seqlens):
            return cudnn.cudnn_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    if _backend == "triton" or _triton_attention_runs(_backend, q.device.type, q.shape[-1], q.dtype):
        # The one-pass backward (Hopper, not deterministic) needs an fp32 dQ workspace that only plans made for
        # cuDNN's backward count, where it fits theirs (one_pass_fits_cudnn_plan); else the two-kernel one
        # runs. (A job with deterministic=true is never planned for cuDNN: the first test is a safeguard.)
        deterministic = _deterministic or not (_attention_kernel == "cudnn" and _one_pass_fits(q, k))
        return _triton_op("attention")(q, k, v, causal=causal, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale,
                                       deterministic=deterministic)
    return reference.attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)


def _one_pass_fits(q, k) -> bool:
    batch, seqlen, q_heads, head_dim = q.shape
    return one_pass_fits_cudnn_plan(batch * seqlen, q_heads, k.shape[2], head_dim, q.element_size())


def one_pass_fits_cudnn_plan(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> bool:
    """Whether the one-pass backward's accumulator (kernels.attention_workspace) fits the workspace a cuDNN plan
    counted for this shape (kernels.cudnn_attention)."""
    from kernels import attention_workspace, cudnn_attention
    return (attention_workspace.one_pass_workspace_bytes(tokens, q_heads, kv_heads, head_dim)
            <= cudnn_attention.backward_workspace_bytes(tokens, q_heads, kv_heads, head_dim, dtype_bytes))


def linear_cross_entropy(hidden, weight, targets, ignore_index=-100, reduction="mean"):
    return _pick("linear_cross_entropy", hidden)(hidden, weight, targets, ignore_index=ignore_index,
                                                 reduction=reduction)


def adamw_update(param, grad, exp_avg, exp_avg_sq, **hyperparameters):
    """In-place fused AdamW step with stochastic rounding of bf16 state (reference.adamw_update)."""
    _pick("adamw_update", param)(param, grad, exp_avg, exp_avg_sq, **hyperparameters)
