"""Which attention runs, and why: the route of a job's attention calls, chosen in one place (`choose_route`).

A route names the implementation of each pass:
  forward   "gluon"      our warp-specialized Hopper kernel (flash_attention_hopper.py)
            "triton"     our Triton kernel (flash_attention.py over triton_kernels.py)
            "reference"  plain PyTorch (kernels/reference.py), which records nothing on an attention tape
            (and before cuDNN's backward, cuDNN's own forward where the Gluon kernel cannot read the inputs)
  backward  "cudnn"      cuDNN's fused backward (cudnn_attention.py; dQ by atomics, a workspace the plan counts)
            "gluon"      our one-pass Hopper backward (flash_attention_hopper_backward.py; dQ by TMA reductions,
                         an fp32 accumulator)
            "triton"     our two-kernel Triton backward (no atomics: bit-identical run to run)
            "reference"  autograd through the reference
and whether the job asked for bit-identical runs, whether a call our kernels do not take falls back to the
reference (kernels=auto) rather than failing with their message (kernels=triton), and the process group
attention runs sequence-parallel over (Ulysses, sequence_parallel.py), if any.

The planner tries `candidates` (fastest first) and its MemoryPlan records the route it counted bytes for;
trainer.build installs that route on the model's attention modules, whose forward calls `attention`. Facts
only a call knows refine the route there, in the methods below: a row cuDNN does not take (packed documents),
inputs whose layout the Gluon kernels cannot read, and whether the one-pass backward's workspace fits what
the plan counted. Speeds behind these choices: docs/PERFORMANCE.md.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

import kernels.attention.attention_workspace as attention_workspace
import kernels.attention.cudnn_attention as cudnn_attention
import kernels.dispatch as dispatch
import kernels.reference as reference
from conf.capability import GpuCapability, gpu_capability
from kernels.attention.support import tma_compatible, triton_takes

FORWARDS = ("gluon", "triton", "reference")
BACKWARDS = ("cudnn", "gluon", "triton", "reference")


@dataclass(frozen=True)
class AttentionRoute:
    """Which forward and backward a job's attention calls run (module doc); `choose_route` makes it."""
    forward: str = "triton"
    backward: str = "triton"
    deterministic: bool = False
    falls_back: bool = False
    sequence_group: Any = dataclasses.field(default=None, compare=False)
    # Whether its calls record (out, lse) on an attention tape, so that keeping attention outputs
    # (memory.kept_attention_layers) helps: not the reference's, nor calls our kernels refuse (kernels=triton
    # with a head dim or dtype they lack, which their checks name at the first call).
    records: bool = True

    def __post_init__(self):
        if self.forward not in FORWARDS or self.backward not in BACKWARDS:
            raise ValueError(f"an attention route runs a forward of {FORWARDS} and a backward of {BACKWARDS}, "
                             f"not {self.forward!r} and {self.backward!r}")
        if self.forward == "reference":
            object.__setattr__(self, "records", False)

    @property
    def plan_kernel(self) -> str:
        """The attention whose memory the planner counts (offload.byte_model): "cudnn" (its backward's
        workspace) or "flash" (our kernels and the reference)."""
        return "cudnn" if self.backward == "cudnn" else "flash"

    def for_call(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens) -> AttentionRoute:
        """The route of one call: the reference for inputs our kernels do not take under kernels=auto (a CPU
        tensor, a head dim or dtype they lack); under a cuDNN backward, rows cuDNN does not take (packed
        documents, cudnn_attention.supports) run our backward: the one-pass one where its accumulator fits the
        workspace the plan counted for cuDNN's and bit-identical runs were not asked for, else the two-kernel one."""
        if self.forward == "reference" or (self.falls_back and not (q.is_cuda and triton_takes(q.shape[-1], q.dtype))):
            return dataclasses.replace(self, forward="reference", backward="reference")
        if self.backward != "cudnn" or (q.is_cuda and cudnn_attention.supports(q, k, cu_seqlens)):
            return self
        one_pass = not self.deterministic and _one_pass_fits(q, k)
        return dataclasses.replace(self, backward="gluon" if one_pass else "triton")

    def forward_runs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
        """The forward a call runs: the Gluon kernel where the route names it and the kernel reads these
        inputs (flash_attention_hopper.takes: 16-bit, a token's heads within its row; tensor descriptors' alignment
        too before cuDNN's backward); otherwise Triton's, or before cuDNN's backward cuDNN's own forward."""
        import kernels.attention.flash_attention_hopper as flash_attention_hopper
        gluon = self.forward == "gluon" and flash_attention_hopper.takes(q, k, v)
        if self.backward == "cudnn":
            return "gluon" if gluon and all(tma_compatible(t) for t in (q, k, v)) else "cudnn"
        return "gluon" if gluon else "triton"

    def backward_runs(self, q: torch.Tensor, do: torch.Tensor) -> str:
        """Our backward for this dO: the one-pass Gluon one where the route names it and the kernel reads q
        and dO through one descriptor over all heads (a broadcast dO, from out.sum(), it cannot), else Triton's."""
        import kernels.attention.flash_attention_hopper as flash_attention_hopper
        import kernels.attention.flash_attention_hopper_backward as flash_attention_hopper_backward
        one_pass = (self.backward == "gluon" and flash_attention_hopper.supports(q)
                    and flash_attention_hopper_backward.supports(q, do) and tma_compatible(do))
        return "gluon" if one_pass else "triton"


def choose_route(device: torch.device, head_dim: int, backend: str, deterministic: bool = False,
                 cudnn_fits: bool = True, dtype: torch.dtype | None = None, planned_gpu: GpuCapability | None = None,
                 sequence_group=None) -> AttentionRoute:
    """Which attention runs here, and why.

    - The reference (plain PyTorch) under kernels=reference, and under kernels=auto where our kernels do not
      run: off CUDA, or a head dim or dtype they lack (the tiny model's head dim 16). dtype None: the model's,
      which our kernels take.
    - Otherwise our kernels (kernels=triton asks for them anywhere, Triton's interpreter included; a head dim
      or dtype they lack then fails at the first call, with their message): the forward is the Gluon kernel
      on a GPU that runs Hopper code (faster than Triton's and cuDNN's), else Triton's.
    - The backward is cuDNN's where it is faster, on Hopper (conf.capability), if the job did
      not ask for bit-identical runs (cuDNN adds dQ with atomics), runs kernels=auto, and the memory plan has
      room for its workspace (`cudnn_fits`, the planner's choice among `candidates`). Else our two-kernel
      Triton backward, which needs no workspace and adds no atomics.
    planned_gpu: planning for a GPU other than this machine's (scripts/plan.py memory.gpu=...), its capability:
    it decides the backward on a CUDA device, and the forward too where no GPU is visible. Per-call
    refinements (packed rows, layouts, the one-pass backward): AttentionRoute's methods."""
    falls_back = backend == "auto"
    takes = triton_takes(head_dim, dtype)
    if backend == "reference" or (falls_back and not (device.type == "cuda" and takes)):
        return AttentionRoute("reference", "reference", deterministic, falls_back, sequence_group)
    # The planned GPU decides the backward, whose workspace the plan counts; the forward is this machine's GPU's,
    # or the planned one's where none is visible.
    here = gpu_capability(device)
    planned = planned_gpu if planned_gpu is not None and device.type == "cuda" else here
    forward = "gluon" if (here if torch.cuda.is_available() else planned).hopper else "triton"
    cudnn = falls_back and not deterministic and cudnn_fits and planned.cudnn_attention_backward
    return AttentionRoute(forward, "cudnn" if cudnn else "triton", deterministic, falls_back, sequence_group, takes)


def candidates(device: torch.device, head_dim: int, backend: str, deterministic: bool = False,
               planned_gpu: GpuCapability | None = None) -> tuple[AttentionRoute, ...]:
    """The routes the memory planner tries, fastest first: `choose_route`'s where cuDNN's workspace fits,
    then where it does not (one route where both are the same)."""
    routes = (choose_route(device, head_dim, backend, deterministic, fits, planned_gpu=planned_gpu)
              for fits in (True, False))
    return tuple(dict.fromkeys(routes))


def default_route(q: torch.Tensor) -> AttentionRoute:
    """The route of a model no build installed one on (tests, tools): `choose_route` for the tensor under
    the ops' backend (kernels.set_backend), on one process, with no plan counting cuDNN's workspace."""
    return choose_route(q.device, q.shape[-1], dispatch.get_backend(), cudnn_fits=False, dtype=q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: AttentionRoute | None = None, *,
              causal: bool = True, cu_seqlens: torch.Tensor | None = None,
              softmax_scale: float | None = None) -> torch.Tensor:
    """Attention with the signature and layout of `kernels.reference.attention`, run by `route` (None:
    `default_route`); sequence-parallel over its group, if any, each rank holding a slice of the tokens."""
    route = default_route(q) if route is None else route
    if route.sequence_group is not None:
        from kernels.attention.sequence_parallel import ulysses_attention
        return ulysses_attention(functools.partial(_on_this_rank, route), q, k, v, route.sequence_group,
                                 causal=causal, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)
    return _on_this_rank(route, q, k, v, causal=causal, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)


def _on_this_rank(route: AttentionRoute, q, k, v, causal=True, cu_seqlens=None, softmax_scale=None):
    call = route.for_call(q, k, cu_seqlens)
    if call.forward == "reference":
        return reference.attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)
    if call.backward == "cudnn":
        return cudnn_attention.cudnn_attention(q, k, v, call, causal=causal, softmax_scale=softmax_scale)
    from kernels.attention.function import FlashAttentionFunction
    return FlashAttentionFunction.apply(q, k, v, causal, cu_seqlens, softmax_scale, call)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    cu_seqlens: torch.Tensor | None = None, softmax_scale: float | None = None,
                    deterministic: bool = False) -> torch.Tensor:
    """Our kernels whatever the device and settings (tests, benchmarks): the Gluon forward where it reads the
    inputs, else Triton's; the one-pass Gluon backward where it reads them unless `deterministic` (bit-identical
    gradients run to run), else the Triton two-kernel one."""
    route = AttentionRoute("gluon", "triton" if deterministic else "gluon", deterministic)
    return attention(q, k, v, route, causal=causal, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)


def _one_pass_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    batch, seqlen, q_heads, head_dim = q.shape
    return one_pass_fits_cudnn_plan(batch * seqlen, q_heads, k.shape[2], head_dim, q.element_size())


def one_pass_fits_cudnn_plan(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> bool:
    """Whether the one-pass backward's accumulator (attention_workspace) fits the workspace a cuDNN plan counted
    for this shape (cudnn_attention.backward_workspace_bytes)."""
    return (attention_workspace.one_pass_workspace_bytes(tokens, q_heads, kv_heads, head_dim)
            <= cudnn_attention.backward_workspace_bytes(tokens, q_heads, kv_heads, head_dim, dtype_bytes))
