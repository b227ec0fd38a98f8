"""The CUDA caching allocator's settings for training: expandable segments, applied before torch initializes
CUDA, and the cap that holds a plan made for a smaller GPU to that GPU's size."""
import os


def prefer_expandable_segments() -> None:
    """Expandable segments: the blocks the backward frees (layer activations, whole [tokens, hidden] tensors)
    are reused for allocations of other sizes (gradients, the next layer's recomputation) instead of
    fragmenting fixed segments, so the measured peak follows the planner's byte counts. A setting already
    in PYTORCH_CUDA_ALLOC_CONF wins."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def memory_cap_fraction(planned: int, present: int) -> float | None:
    """The share of a GPU of `present` bytes that holds the allocator to the `planned` bytes of the GPU the
    plan was made for (memory.gpu or memory.gpu_memory_gib); None when the present GPU is not bigger."""
    return planned / present if 0 < planned < present else None


def present_gpu_memory(device) -> int | None:
    """Total bytes of the CUDA device `device`; None for any other device."""
    import torch
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device).total_memory


def gpu_memory_cap(planned: int, device) -> float | None:
    """memory_cap_fraction on `device` (None off CUDA)."""
    present = present_gpu_memory(device)
    return None if present is None else memory_cap_fraction(planned, present)


def cap_gpu_memory(planned: int, device) -> None:
    """Hold this process's CUDA caching allocator on `device` to `planned` bytes when the GPU present is bigger,
    so that a plan made for a smaller card (an 80 GB one, on a 141 GB H200) is what runs, and can be tested,
    here: an allocation past it fails as it would there; else lift any cap (the jobs of a sweep share one
    process, and an earlier job's cap would hold a later one). Call once per job, before the model is built."""
    import torch
    if present_gpu_memory(device) is None:
        return
    # torch takes an indexed device only: "cuda" alone is the current one
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_per_process_memory_fraction(gpu_memory_cap(planned, device) or 1.0, index)


def gpu_cap_note(planned: int, device) -> str:
    """The startup summary's words for the cap cap_gpu_memory applies ("" for none)."""
    from offload.units import GIB
    fraction = gpu_memory_cap(planned, device)
    if fraction is None:
        return ""
    return (f"; CUDA allocator capped at {planned / GIB:.1f} of this GPU's {planned / fraction / GIB:.1f} GiB "
            f"(memory.gpu / memory.gpu_memory_gib), so the plan's GPU is what runs")
