"""Attention: which implementation runs (route.py, the one place that decides), and the implementations.

  route.py           AttentionRoute, choose_route (which attention runs here, and why), candidates (what the
                     memory planner tries), attention (runs a route; the model calls it), flash_attention
                     (our kernels whatever the settings: tests, benchmarks)
  function.py        our attention as one autograd function: packed documents, attention tape, prefix tuning
  flash_attention.py, triton_kernels.py     the Triton forward and two-kernel backward (every GPU; A100 too)
  flash_attention_hopper.py, flash_attention_hopper_backward.py     the Gluon forward and one-pass backward
  cudnn_attention.py cuDNN's backward (aten ops) after our forward, on Hopper
  support.py         what the kernels take, free of Triton (the route and planner ask it); where they run:
                     conf/capability.py
  attention_tape.py  attention outputs reused by a checkpoint's recomputation
  attention_workspace.py, _attention_tiles.py, tuning_cache.py, sequence_parallel.py     their helpers

Importing this package imports no Triton (route.py loads the kernels on first use): Triton decides between
interpreter and compiler when it is first imported, which tests and tools do after importing the model.
"""
from kernels.attention.route import AttentionRoute, attention, candidates, choose_route

__all__ = ["AttentionRoute", "attention", "candidates", "choose_route"]
