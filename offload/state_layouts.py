"""Where full fine-tuning keeps weights, gradients and AdamW state: the layouts the planner chooses from.

State layouts, bytes per parameter (Llama-3-8B has 8.03e9 parameters, so 1 B/param = 7.5 GiB):

  fp32            fp32 weights + grads + torch AdamW moments, all on the GPU     16 GPU           (120 GiB)
  bf16            bf16 weights + grads + moments on the GPU                        8 GPU            (60 GiB)
  bf16_host_grads bf16 weights + moments on the GPU, grads in pinned host memory   6 GPU + 2 host   (45 + 15)

`plan_memory` (offload.plan) takes the first layout of `FULL_STATE_LAYOUTS` (conf.schema.train) that fits the
machine for train.full_state=auto; the bf16 layouts are trained by trainer.streamed_adamw.StreamedAdamW.
"""
from __future__ import annotations

import torch

from conf.schema.train import FULL_STATE_LAYOUTS


# Over several processes without FSDP2 (parallel.shard=false): fp32 weights and torch AdamW on each GPU, as
# StreamedAdamW takes each gradient in the backward, before World.sum_gradients sums it over the ranks. Sharded,
# every layout runs: FSDP2 reduces a gradient before StreamedAdamW takes its shard.
DISTRIBUTED_LAYOUTS = ("fp32",)


def layouts_to_try(full_state: str) -> tuple[str, ...]:
    """The layouts the planner tries, best first: all of them for "auto", else the one asked for."""
    return FULL_STATE_LAYOUTS if full_state == "auto" else (full_state,)


def weights_dtype(layout: str) -> torch.dtype:
    return torch.float32 if layout == "fp32" else torch.bfloat16


def layout_memory(layout: str, params: int) -> tuple[dict[str, int], dict[str, int]]:
    """(GPU items, pinned host items) in bytes of `params` trainable parameters under `layout` (host
    items before the pinned allocator's rounding)."""
    if layout == "fp32":
        return {"fp32 weights+grads+adam": 16 * params}, {}
    gpu = {"bf16 weights": 2 * params, "bf16 adam moments": 4 * params}
    if layout == "bf16":
        return gpu | {"bf16 gradients": 2 * params}, {}
    return gpu, {"pinned gradients": 2 * params}
