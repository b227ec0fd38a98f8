"""Synthetic long-range recall: the embedded default task, needing no tokenizer and no files.

Each sequence is BOS, filler noise with facts "value key" scattered through it, then queries
"QUERY key" at the end. Every fact recurs `repeats` times; at each recurrence of a key after its first
and at each query, the target predicted at the key is the value filed under it, found by looking back
for the same key. Only those recalled values are supervised (they are targets, not the next tokens), so
chance accuracy is 1 / num_values. Writing the value before its key lets the lookup match the key token
itself, so a tiny model learns it within minutes on a CPU; the repeats make the signal dense.
"""
from __future__ import annotations

import torch

from conf.schema.data import RECALL_SPECIAL_TOKENS, DataConfig
from data.batch import IGNORE_INDEX, Batch

# The special tokens; ids up to RECALL_SPECIAL_TOKENS - 1 are reserved, keys start at RECALL_SPECIAL_TOKENS.
BOS, EOS, QUERY = 1, 2, 3


class RecallTask:
    """An endless, seeded stream of recall batches; batch i depends only on (seed, i), so resuming is
    restoring the index. `cfg` has passed conf.schema.data.check_recall for this seq_len and vocab_size."""

    def __init__(self, cfg: DataConfig, seq_len: int, batch_size: int, seed: int, vocab_size: int):
        self.cfg, self.seq_len, self.batch_size, self.seed = cfg, seq_len, batch_size, seed
        self.first_value = RECALL_SPECIAL_TOKENS + cfg.num_keys
        self.first_filler = self.first_value + cfg.num_values
        self.vocab_size = vocab_size
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.index)
        self.index += 1
        rows = [self._sequence(generator) for _ in range(self.batch_size)]
        input_ids = torch.stack([ids for ids, _ in rows])
        labels = torch.stack([lab for _, lab in rows])
        positions = torch.arange(self.seq_len).expand(self.batch_size, self.seq_len).clone()
        return Batch(input_ids, labels, positions)

    def _sequence(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, length = self.cfg, self.seq_len
        tokens = torch.randint(self.first_filler, self.vocab_size, (length,), generator=generator)
        tokens[0] = BOS
        keys = RECALL_SPECIAL_TOKENS + torch.randperm(cfg.num_keys, generator=generator)[:cfg.num_pairs]
        values = self.first_value + torch.randint(0, cfg.num_values, (cfg.num_pairs,), generator=generator)
        query_start = length - 2 * cfg.num_queries
        # Occurrences take disjoint 2-token slots spread over the whole body, in random order.
        occurrences = cfg.num_pairs * cfg.repeats
        slots = 1 + 2 * torch.randperm((query_start - 1) // 2, generator=generator)[:occurrences].sort().values
        pair_of_slot = torch.arange(cfg.num_pairs).repeat(cfg.repeats)[torch.randperm(occurrences, generator=generator)]
        # A fact is written "value key"; later the key alone asks for its value.
        tokens[slots], tokens[slots + 1] = values[pair_of_slot], keys[pair_of_slot]
        labels = torch.full((length,), IGNORE_INDEX)
        seen = set()
        for slot, pair in zip(slots.tolist(), pair_of_slot.tolist()):
            if pair in seen:
                labels[slot + 1] = values[pair]    # a recurrence: its value was shown earlier
            seen.add(pair)
        asked = torch.randperm(cfg.num_pairs, generator=generator)[:cfg.num_queries]
        for i, pair in enumerate(asked.tolist()):
            at = query_start + 2 * i
            tokens[at], tokens[at + 1] = QUERY, keys[pair]
            labels[at + 1] = values[pair]          # predicted at the key, i.e. the next token
        return tokens, labels

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict, force: bool = False) -> None:
        """`force` changes nothing: the sample index is a valid position under any settings."""
        self.index = int(state["index"])
