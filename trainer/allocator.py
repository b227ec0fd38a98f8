"""The CUDA caching allocator's settings for training, applied before torch initializes CUDA."""
import os


def prefer_expandable_segments() -> None:
    """Expandable segments: the blocks the backward frees (layer activations, whole [tokens, hidden] tensors)
    are reused for allocations of other sizes (gradients, the next layer's recomputation) instead of
    fragmenting fixed segments, so the measured peak follows the planner's byte counts. A setting already
    in PYTORCH_CUDA_ALLOC_CONF wins."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
