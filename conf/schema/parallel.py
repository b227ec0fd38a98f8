"""The `parallel` group: how a job launched on several processes (torchrun) splits its work, with its check.

`parallel.sequence=P` splits each sequence over P ranks (Ulysses sequence parallelism: each rank holds
seq_len / P tokens, attention exchanges heads for tokens); the ranks of the world beyond that are data
parallel (world size / P different batches per step). One process: P must be 1. `parallel.shard=true`
shards the weights over the world (FSDP2, trainer.sharding): full fine-tuning's with their gradients and
optimizer state (in any train.full_state; the bf16 ones run over several processes only sharded), LoRA's
frozen base with the adapters.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from conf.errors import ConfigError


@dataclass
class ParallelConfig:
    sequence: int = 1
    # FSDP2: split each layer's weights (and what trains, with its gradients and optimizer state) over the
    # world; with one process there is nothing to split and it is ignored.
    shard: bool = False


def heads_split(q_heads: int, kv_heads: int, degree: int) -> bool:
    """Whether Ulysses can shard these heads over `degree` ranks: the KV heads evenly or repeated evenly
    (kernels.attention.sequence_parallel); query heads the degree does not divide are padded
    (padded_query_heads)."""
    return kv_heads % degree == 0 or degree % kv_heads == 0


def padded_query_heads(q_heads: int, kv_heads: int, degree: int) -> int:
    """The query heads Ulysses shards over `degree` ranks (KV heads that split or repeat evenly, heads_split):
    `q_heads` where the degree divides them, else each KV head's group of query heads padded with zero heads
    up to a multiple of the ranks that share its KV head, so that every rank's query heads read one KV head.
    Qwen2.5-7B over 8 ranks: 4 KV heads, each repeated on 2 ranks, groups of 7 padded to 8, 32 heads, 4 a rank."""
    ranks_per_kv_head = max(1, degree // kv_heads)
    group = q_heads // kv_heads
    return kv_heads * -(-group // ranks_per_kv_head) * ranks_per_kv_head


def world_size() -> int:
    """Processes of this job, as torchrun says (WORLD_SIZE); 1 without it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_parallel(cfg, world: int | None = None) -> None:
    """parallel.sequence against the world (this job's, or `world` processes), the sequence length and the
    model's heads."""
    degree, world = cfg.parallel.sequence, world or world_size()
    if degree < 1:
        raise ConfigError(f"parallel.sequence={degree} must be at least 1")
    if world % degree:
        raise ConfigError(f"parallel.sequence={degree} must divide the {world} processes of this job "
                          f"(torchrun --nproc-per-node); the rest of the world is data parallel")
    if cfg.seq_len % degree:
        raise ConfigError(f"seq_len={cfg.seq_len} must be a multiple of parallel.sequence={degree}: each rank "
                          f"holds an equal slice")
    streamed = cfg.train.mode == "full" and cfg.train.full_state not in ("auto", "fp32")
    if world > 1 and streamed and not cfg.parallel.shard:
        raise ConfigError(f"train.full_state={cfg.train.full_state} runs over several processes only sharded (FSDP2 "
                          f"sums each gradient over the ranks before the optimizer takes it): set parallel.shard=true, "
                          f"or train.full_state=fp32 (16 bytes per parameter on each GPU)")
    heads, kv_heads = cfg.model.num_attention_heads, cfg.model.num_key_value_heads
    if not heads_split(heads, kv_heads, degree):
        raise ConfigError(f"parallel.sequence={degree} shards attention heads: it must divide or be a multiple of "
                          f"the model's {kv_heads} KV heads (its {heads} query heads are padded to a multiple)")
