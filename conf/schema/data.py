"""The `data` config group: the synthetic recall task or local files, and the checks of its values.

Checks that must look at the disk (data.path resolves to files, model.path holds a tokenizer) are the data
layer's `preflight_data`, run by the trainer right after `validate`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from conf.errors import ConfigError

DATA_SOURCES = ("recall", "files")
FORMATS = ("auto", "text", "chat")
TEXT_UNITS = ("document", "paragraph", "line")
# Which tokens of a chat are trained on.
LOSS_ON = ("all", "assistant", "last_turn")
# What happens to a document longer than seq_len (data.long_docs=auto picks one by format).
LONG_DOC_POLICIES = ("split", "drop", "truncate")
# Token ids the recall task reserves (BOS, EOS, QUERY and spares) below its keys, values and filler.
RECALL_SPECIAL_TOKENS = 8


@dataclass
class DataConfig:
    # recall: the embedded synthetic long-range key->value recall task.
    # files: local json/jsonl/parquet/text files, folders or globs of them, or a save_to_disk directory.
    name: str = "recall"
    # Recall task: `num_pairs` key/value bigrams, each occurring `repeats` times scattered through filler,
    # then `num_queries` queries "QUERY key"; recalled values are the only supervised tokens.
    num_pairs: int = 16
    repeats: int = 8
    num_queries: int = 16
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


def check_data(data_cfg, seq_len: int, vocab_size: int, model_path: str | None) -> None:
    """Reject data settings that cannot work; model_path is model.path, where the files source finds its
    tokenizer."""
    if data_cfg.name == "recall":
        check_recall(data_cfg, seq_len, vocab_size)
    elif data_cfg.name == "files":
        check_files(data_cfg, model_path)
    else:
        raise ConfigError(f"unknown data source data.name={data_cfg.name!r}; available: {', '.join(DATA_SOURCES)}")


def check_recall(data_cfg, seq_len: int, vocab_size: int) -> None:
    """Settings the recall task cannot be generated with, naming what to change."""
    needed_vocab = RECALL_SPECIAL_TOKENS + data_cfg.num_keys + data_cfg.num_values + 1
    if vocab_size < needed_vocab:
        raise ConfigError(f"data=recall needs model.vocab_size >= {needed_vocab} ({RECALL_SPECIAL_TOKENS} special "
                          f"tokens + data.num_keys={data_cfg.num_keys} + data.num_values={data_cfg.num_values} + "
                          f"filler), got {vocab_size}: lower num_keys/num_values or use a larger vocabulary")
    if data_cfg.num_pairs > data_cfg.num_keys:
        raise ConfigError(f"data.num_pairs ({data_cfg.num_pairs}) must be <= data.num_keys ({data_cfg.num_keys}): "
                          f"keys in one sequence are distinct")
    if not 1 <= data_cfg.num_queries <= data_cfg.num_pairs:
        raise ConfigError(f"data.num_queries ({data_cfg.num_queries}) must be between 1 and data.num_pairs "
                          f"({data_cfg.num_pairs})")
    if data_cfg.repeats < 1:
        raise ConfigError(f"data.repeats={data_cfg.repeats} must be at least 1")
    occurrences = data_cfg.num_pairs * data_cfg.repeats
    # BOS, then 2-token slots for every occurrence, then 2 tokens per query.
    if (seq_len - 2 * data_cfg.num_queries - 1) // 2 < occurrences:
        raise ConfigError(f"seq_len={seq_len} is too short for data.num_pairs={data_cfg.num_pairs} x "
                          f"data.repeats={data_cfg.repeats} and data.num_queries={data_cfg.num_queries}: "
                          f"use seq_len >= "
                          f"{2 * occurrences + 2 * data_cfg.num_queries + 2} or fewer pairs/repeats")


def check_files(data_cfg, model_path: str | None) -> None:
    """Option values of the files source, and the two paths it cannot do without."""
    choices = {"format": (data_cfg.format, FORMATS), "loss_on": (data_cfg.loss_on, LOSS_ON),
               "long_docs": (data_cfg.long_docs, ("auto",) + LONG_DOC_POLICIES),
               "text_unit": (data_cfg.text_unit, TEXT_UNITS)}
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"data.{name}={value!r} is not one of {allowed}")
    if data_cfg.num_proc < 0:
        raise ConfigError(f"data.num_proc={data_cfg.num_proc} must be >= 0 (0 picks by dataset size)")
    if not data_cfg.path:
        raise ConfigError("data=files needs data.path=<file, folder, glob or save_to_disk directory>")
    if not model_path:
        raise ConfigError("data=files needs a tokenizer: set model.path=<local Hugging Face checkpoint directory "
                          "with its tokenizer files>")
