"""Held-out sequences for evaluation (conf/schema/eval.py): files of their own (eval.path), a fraction of
the training documents split off by document (eval.fraction), or for the recall task sequences from another
seed. They have the training seq_len, batch size and packing; every evaluation of a run (and of a resumed
run) reads the same ones.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass


from conf.schema.data import DataConfig
from data.batch import Batch
from data.documents import SPLIT_SEED, split_documents
from data.files import packed_documents, tokenized_documents
from data.synthetic import RecallTask

log = logging.getLogger(__name__)

# The recall task's held-out sequences: seed + this. A training stream reaches them only after 2^20 batches
# (data.synthetic seeds batch i of seed s with s * 1_000_003 + i).
RECALL_SEED_OFFSET = 1 << 20


@dataclass
class HeldOut:
    batches: list[Batch]
    # The held-out documents' text as token ids without BOS/EOS (passkey filler); None for the recall task
    # and chat data.
    text: list[int] | None


def held_out_data(cfg: DataConfig, path: str | None, fraction: float, seq_len: int, batch_size: int, seed: int,
                  vocab_size: int, tokenizer_path: str | None, batches: int) -> HeldOut:
    """`batches` held-out batches of the data source `cfg`: from the files at `path` (eval.path), else the
    `fraction` of the training files' documents that training leaves out, else recall sequences."""
    if cfg.name == "recall":
        stream = RecallTask(cfg, seq_len, batch_size, seed + RECALL_SEED_OFFSET, vocab_size)
        return HeldOut([next(stream) for _ in range(batches)], None)
    documents, fmt, tokenizer = tokenized_documents(cfg, path or cfg.path, vocab_size, tokenizer_path,
                                                    "eval.path" if path else "data.path")
    if not path:
        documents = documents.select(split_documents(len(documents), fraction)[1])
    stream = packed_documents(documents, cfg, fmt, tokenizer, seq_len, batch_size, SPLIT_SEED)
    log.info("held-out %s", stream.stats.line())
    if stream.rows_in_epoch < batches * batch_size:
        log.warning("the held-out data fill %d sequences of seq_len=%d, fewer than the %d evaluated: some repeat "
                    "(more held-out documents, or a lower eval.sequences)", stream.rows_in_epoch, seq_len,
                    batches * batch_size)
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    text = document_text(documents, seq_len, special) if fmt == "text" else None
    return HeldOut([next(stream) for _ in range(batches)], text)


def document_text(documents, tokens: int, special: set) -> list[int]:
    """The first `tokens` token ids of the documents in order, special tokens left out (all there are, when
    fewer)."""
    text: list[int] = []
    for index in range(len(documents)):
        text += [token for token in documents[index]["input_ids"] if token not in special]
        if len(text) >= tokens:
            break
    return text[:tokens]
