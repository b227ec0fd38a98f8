"""Configuration of the `data` group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DataConfig:
    # recall: the embedded synthetic long-range key->value recall task.
    # files: local json/jsonl/parquet/text files, folders or globs of them, or a save_to_disk directory.
    name: str = "recall"
    # Recall task: `num_pairs` key/value bigrams, each occurring `repeats` times scattered through filler,
    # then `num_queries` queries "QUERY key"; recalled values are the only supervised tokens.
    num_pairs: int = 16
    repeats: int = 4
    num_queries: int = 4
    num_keys: int = 64
    num_values: int = 32

    # --- files source (see docs/DATA.md) ---
    # A file, a folder of files, a glob, or a directory written by datasets' save_to_disk.
    path: Optional[str] = None
    # Split to take when the save_to_disk directory holds a DatasetDict.
    split: str = "train"
    # auto: `chat` when records have `messages_field`, else `text`.
    format: str = "auto"
    text_field: str = "text"
    messages_field: str = "messages"
    # Plain-text files: one record per `document` (whole file), `paragraph` or `line`.
    text_unit: str = "document"
    # Chat only: which tokens are trained on: all | assistant | last_turn (the last assistant message).
    loss_on: str = "assistant"
    # True: concatenate documents into seq_len rows (cu_seqlens keeps them apart); False: one per row.
    pack: bool = True
    # Documents longer than seq_len: split | drop | truncate; auto = split for text, drop for chat.
    long_docs: str = "auto"
    # BOS/EOS per document, when the tokenizer defines them and the document does not already have them.
    add_bos: bool = True
    add_eos: bool = True
    # Tokenization processes; 0 picks by dataset size (1 for small datasets).
    num_proc: int = 0
    # Where raw-file conversions and tokenized documents are cached; None: datasets' default cache.
    cache_dir: Optional[str] = None
