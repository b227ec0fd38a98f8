"""Configuration of the `data` group."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    # recall: the embedded synthetic long-range key->value recall task.
    name: str = "recall"
    # Recall task: `num_pairs` key/value bigrams scattered through filler, then `num_queries` queries
    # "QUERY key" whose answer (the paired value) is the only supervised token.
    num_pairs: int = 16
    num_queries: int = 4
    num_keys: int = 64
    num_values: int = 32
