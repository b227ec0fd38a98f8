"""What a GPU runs, decided in one place (`gpu_capability`): our Hopper attention kernels, FP8 products, cuDNN's
fused attention backward. For a GPU of this machine, as this process runs it, or for one named by memory.gpu
(planning for it). No other module reads a compute capability (tests/test_capability.py), so no two checks can
disagree about a GPU. In conf, the layer every package may import: conf's own checks ask it too."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# The compute capability of each GPU memory.gpu names (conf.schema.memory.GPU_PRESETS: their memory).
PRESET_COMPUTE_CAPABILITIES = {"a100_80gb": (8, 0), "h100_80gb": (9, 0), "h200": (9, 0)}
# TRITON_OVERRIDE_ARCH values under which Triton still compiles Hopper code on a Hopper GPU ("": unset);
# sm80 compiles the A100's code there, to test and time it.
HOPPER_TARGETS = ("", "sm90", "sm90a")


def triton_interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1, read by Triton when it
    is first imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class GpuCapability:
    """What one GPU runs; `gpu_capability` makes it."""
    name: str                                         # torch's name for the device, or the memory.gpu preset
    compute_capability: tuple[int, int] | None = None     # None: no GPU
    # Our Hopper (Gluon) attention kernels: compute capability 9.x, with Triton compiling Hopper code for it
    # (not the A100's under TRITON_OVERRIDE_ARCH=sm80, nor its CPU interpreter, which cannot run Gluon).
    hopper: bool = False
    # FP8 tensor cores with cuBLAS's row-scaled FP8 product, the one measured: compute capability 9.0+.
    fp8: bool = False
    # cuDNN's fused attention backward, which is the faster one from Hopper on: 9.0+, with cuDNN enabled and
    # torch's aten op for it.
    cudnn_attention_backward: bool = False


NO_GPU = GpuCapability("no GPU")


def gpu_capability(gpu: torch.device | str) -> GpuCapability:
    """What `gpu` runs: a device of this machine, as this process runs it (NO_GPU off CUDA or when no GPU is
    visible), or a GPU to plan for by its memory.gpu name, whose answers are that GPU's own (this machine's
    Triton and cuDNN settings are not asked)."""
    if isinstance(gpu, str):
        capability = PRESET_COMPUTE_CAPABILITIES[gpu]
        return GpuCapability(gpu, capability, hopper=capability[0] == 9, fp8=capability >= (9, 0),
                             cudnn_attention_backward=capability >= (9, 0))
    if gpu.type != "cuda" or not torch.cuda.is_available():
        return NO_GPU
    capability = torch.cuda.get_device_capability(gpu)
    compiles_hopper = not triton_interpreting() and os.environ.get("TRITON_OVERRIDE_ARCH", "") in HOPPER_TARGETS
    cudnn = (torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
             and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward"))
    return GpuCapability(torch.cuda.get_device_name(gpu), capability, hopper=capability[0] == 9 and compiles_hopper,
                         fp8=capability >= (9, 0), cudnn_attention_backward=capability >= (9, 0) and cudnn)
