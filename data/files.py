"""The `files` source: records read by data.records, tokenized once into the datasets cache, then planned,
shuffled and packed by data.packing.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from conf.schema.data import DataConfig
from data.batch import Batch
from data.documents import log_positions_beyond, split_documents, trained_positions
from data.packing import Document, LongDocCounts, assemble_batch, epoch_order, pack_rows, plan_pieces
from data.records import load_records, record_format, record_name, resolve_source
from data.tokenize import (DataError, RecordError, check_text, check_vocabulary, load_tokenizer, tokenize_chat,
                           tokenize_texts, tokenizer_files)

log = logging.getLogger(__name__)

# Bump when tokenization output changes, so cached tokenizations from older code are not reused.
TOKENIZATION_VERSION = 1
# Below this many records one process tokenizes faster than starting several.
RECORDS_PER_EXTRA_PROCESS = 20_000
# Packed rows more padding than this are warned about: the data are short for seq_len.
PADDING_WARNING = 0.5
# The document-length percentiles the data summary reports.
LENGTH_PERCENTILES = (50, 90, 99)


def tokenize_batch(batch: dict, indices: list[int], tokenizer, fmt: str, field: str, loss_on: str,
                   bos_id: int | None, eos_id: int | None) -> dict:
    """datasets.map function: records to documents plus the lengths and target counts the plan reads."""
    if fmt == "chat":
        documents = [tokenize_chat(messages, tokenizer, loss_on, bos_id, eos_id, record=index)
                     for messages, index in zip(batch[field], indices)]
    else:
        for text, index in zip(batch[field], indices):
            check_text(text, field, index)
        documents = tokenize_texts(batch[field], tokenizer, bos_id, eos_id)
    return {"input_ids": [ids for ids, _ in documents], "is_target": [mask for _, mask in documents],
            "length": [len(ids) for ids, _ in documents], "targets": [sum(mask[1:]) for _, mask in documents]}


def tokenizer_fingerprint(tokenizer_path: str) -> list[str]:
    """Content hashes of the tokenizer's files, so a changed tokenizer re-tokenizes."""
    from datasets.fingerprint import Hasher
    return [Hasher.hash(file.read_bytes()) for file in tokenizer_files(Path(tokenizer_path).expanduser())]


def tokenize_records(records, cfg: DataConfig, tokenizer, tokenizer_path: str, fmt: str, field: str):
    """Tokenize every record once; a second run with the same records, tokenizer and options loads the
    result from the cache instead."""
    import datasets
    from datasets.fingerprint import Hasher
    # int32 ids halve the cache of 64-bit defaults; every vocabulary fits.
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")), "is_target": datasets.Sequence(datasets.Value("bool")),
        "length": datasets.Value("int64"), "targets": datasets.Value("int64")})
    bos_id = tokenizer.bos_token_id if cfg.add_bos else None
    eos_id = tokenizer.eos_token_id if cfg.add_eos else None
    key = Hasher.hash([records._fingerprint, tokenizer_fingerprint(tokenizer_path), fmt, field, cfg.loss_on,
                       bos_id, eos_id, TOKENIZATION_VERSION])
    cache = Path(cfg.cache_dir or datasets.config.HF_DATASETS_CACHE).expanduser() / "tokenized"
    cache.mkdir(parents=True, exist_ok=True)
    num_proc = cfg.num_proc or min(os.cpu_count() or 1, 1 + len(records) // RECORDS_PER_EXTRA_PROCESS)
    function = partial(tokenize_batch, tokenizer=tokenizer, fmt=fmt, field=field, loss_on=cfg.loss_on,
                       bos_id=bos_id, eos_id=eos_id)
    return records.map(function, batched=True, with_indices=True, remove_columns=records.column_names,
                       num_proc=num_proc if num_proc > 1 else None, new_fingerprint=key, features=features,
                       cache_file_name=str(cache / f"{key}.arrow"), desc=f"tokenizing {cfg.path}")


@dataclass
class DataStats:
    documents: int
    tokens: int
    targets: int
    sequences: int
    padding_fraction: float
    long_docs: LongDocCounts
    seq_len: int
    length_percentiles: dict[int, int]      # of the non-empty documents' token counts
    longest: int

    def padding_warning(self) -> str | None:
        """A line when rows are mostly padding (PADDING_WARNING), else None."""
        if self.padding_fraction <= PADDING_WARNING:
            return None
        return (f"data: {self.padding_fraction:.1%} of the packed rows is padding ({self.tokens:,} tokens fill "
                f"{self.sequences:,} rows of seq_len={self.seq_len}), so most of each step computes nothing: lower "
                f"seq_len or add data")

    def line(self) -> str:
        mean = self.tokens / max(self.documents, 1)
        long = self.long_docs
        return (f"data: {self.documents:,} documents, {self.tokens:,} tokens (mean {mean:,.1f} per document, "
                f"{self.targets / max(self.tokens, 1):.1%} trained on) -> {self.sequences:,} sequences of "
                f"{self.seq_len} per epoch, padding {self.padding_fraction:.1%}; longer than seq_len: "
                f"{long.split} split, {long.dropped} dropped, {long.truncated} truncated; document lengths: "
                + ", ".join(f"p{p} {self.length_percentiles[p]:,}" for p in LENGTH_PERCENTILES)
                + f", longest {self.longest:,}")


def int_column(documents, name: str) -> np.ndarray:
    """One integer column as a numpy array, read from Arrow in one piece. (`documents[name]` is a lazy
    Column in datasets >= 4 that numpy would read row by row: about half a minute per million documents.)"""
    return documents.with_format("arrow", columns=[name])[:][name].to_numpy().astype(np.int64, copy=False)


def content_fingerprint(documents) -> str:
    """A hash of the tokenized documents in order (lengths, token ids, trained-on flags): what a resume must
    find again. Unlike the datasets fingerprint it does not change when a file is touched, copied or renamed.
    About a second per 200M tokens."""
    digest = hashlib.sha256()
    table = documents.with_format("arrow", columns=["length", "input_ids", "is_target"])[:]
    for name in ("length", "input_ids", "is_target"):
        for chunk in table.column(name).chunks:
            values = chunk if name == "length" else chunk.flatten()
            digest.update(np.ascontiguousarray(values.to_numpy(zero_copy_only=False)))
    return digest.hexdigest()[:16]


class PackedDocuments:
    """An endless stream of batches over tokenized documents, epoch after epoch, each epoch reshuffled
    from (seed, epoch).

    The position in the stream is (epoch, row); the epoch's plan is recomputed from document lengths
    alone, so load_state_dict resumes at the exact next row without reading earlier documents.
    """

    def __init__(self, documents, seq_len: int, batch_size: int, seed: int, pack: bool, long_docs: str,
                 pad_id: int):
        self.documents, self.seq_len, self.batch_size, self.seed, self.pack = documents, seq_len, batch_size, seed, pack
        self.pad_id = pad_id
        lengths = int_column(documents, "length")
        self.pieces, long_counts = plan_pieces(lengths, seq_len, long_docs)
        if not len(self.pieces) and not long_counts.dropped:
            raise DataError(f"no document is left to train on: all {len(lengths)} records tokenize to nothing (empty "
                            f"or whitespace only): check data.text_field / data.messages_field")
        if not len(self.pieces):
            raise DataError(f"no document is left to train on: {long_counts.dropped} of {len(lengths)} documents are "
                            f"longer than seq_len={seq_len} and were dropped; set data.long_docs=split or "
                            f"truncate, or raise seq_len")
        # What the saved position (epoch, row) means: resuming it elsewhere would train on other rows.
        self.plan = {"tokenized documents": content_fingerprint(documents), "seq_len": seq_len, "seed": seed,
                     "data.pack": pack, "data.long_docs": long_docs}
        self.epoch, self.row = 0, 0
        self._plan_epoch(0)
        kept = self.pieces[:, 2] - self.pieces[:, 1]
        present = lengths[lengths > 0]
        # Counted where the rows train them: a token that starts a piece (every token at seq_len=1) predicts
        # nothing, and a dropped document's tokens are not trained.
        self.stats = DataStats(documents=len(present), tokens=int(lengths.sum()),
                               targets=trained_positions(documents, seq_len, long_docs, 0)[0],
                               sequences=self.rows_in_epoch,
                               padding_fraction=1 - kept.sum() / (self.rows_in_epoch * seq_len),
                               long_docs=long_counts, seq_len=seq_len,
                               length_percentiles={p: int(np.percentile(present, p, method="higher"))
                                                   for p in LENGTH_PERCENTILES},
                               longest=int(present.max()))

    def _plan_epoch(self, epoch: int) -> None:
        self.order = epoch_order(len(self.pieces), self.seed, epoch)
        piece_lengths = self.pieces[self.order, 2] - self.pieces[self.order, 1]
        self.rows = pack_rows(piece_lengths, self.seq_len, self.pack)
        self.planned_epoch = epoch

    @property
    def rows_in_epoch(self) -> int:
        return len(self.rows)

    def _take_row(self) -> np.ndarray:
        """The pieces of the next row, moving to the next epoch's plan when this one is used up."""
        if self.planned_epoch != self.epoch:
            self._plan_epoch(self.epoch)
        row = self.pieces[self.order[self.rows[self.row]]]
        self.row += 1
        if self.row == self.rows_in_epoch:
            self.epoch, self.row = self.epoch + 1, 0
        return row

    def _read(self, rows: list[np.ndarray]) -> list[list[Document]]:
        """Token ids and targets of every piece, with one read of the documents involved."""
        wanted = sorted({int(document) for row in rows for document in row[:, 0]})
        columns = self.documents[wanted]
        by_document = dict(zip(wanted, zip(columns["input_ids"], columns["is_target"])))
        return [[(by_document[doc][0][start:end], by_document[doc][1][start:end]) for doc, start, end in row.tolist()]
                for row in rows]

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        rows = [self._take_row() for _ in range(self.batch_size)]
        return assemble_batch(self._read(rows), self.seq_len, self.pad_id, self.pack)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "row": self.row, "plan": self.plan}

    def load_state_dict(self, state: dict, force: bool = False) -> None:
        """Continue at the saved position; a state saved for different data or packing is refused, unless
        `force` (resume_force=true): then the same epoch and row of this data, with a warning."""
        differences = self.plan_differences(state["plan"])
        if differences and not force:
            raise DataError(f"this data state was saved for a different dataset or packing ({differences}): resume "
                            f"with the same data, seq_len, seed and data options, or pass resume_force=true to "
                            f"continue at the same epoch and row of this data")
        self.epoch, self.row = int(state["epoch"]), int(state["row"])
        if differences:
            log.warning("resume_force=true: continuing at epoch %d, row %d of data that differ from the "
                        "checkpoint's (%s)", self.epoch, self.row, differences)
            self._plan_epoch(self.epoch)
            if self.row >= self.rows_in_epoch:     # this data's epoch is shorter: go on with the next one
                self.epoch, self.row = self.epoch + 1, 0

    def plan_differences(self, saved: dict | str) -> str:
        """'key: checkpoint X, now Y' for each part of the plan that differs ('' when none); a plan saved as
        a string (before content hashing) differs in every part."""
        saved = saved if isinstance(saved, dict) else {}
        return "; ".join(f"{key}: checkpoint {saved.get(key)!r}, now {value!r}" for key, value in self.plan.items()
                         if saved.get(key) != value)


def tokenized_documents(cfg: DataConfig, path: str, vocab_size: int, tokenizer_path: str,
                        setting: str = "data.path"):
    """(documents, format, tokenizer) of the files at `path` (named by `setting`), read and tokenized with the
    data.* options (the tokenization cached)."""
    tokenizer = load_tokenizer(tokenizer_path)
    check_vocabulary(tokenizer, vocab_size, tokenizer_path)
    source = resolve_source(path, setting)
    records = load_records(source, cfg)
    fmt, field = record_format(cfg, records, source)
    try:
        documents = tokenize_records(records, cfg, tokenizer, tokenizer_path, fmt, field)
    except RecordError as error:
        raise DataError(f"{record_name(source, cfg, error.record)}, {error.problem}") from None
    return documents, fmt, tokenizer


def long_docs_policy(cfg: DataConfig, fmt: str) -> str:
    """data.long_docs, auto resolved by format: drop for chat (a cut-off reply), split for text."""
    return cfg.long_docs if cfg.long_docs != "auto" else ("drop" if fmt == "chat" else "split")


def packed_documents(documents, cfg: DataConfig, fmt: str, tokenizer, seq_len: int, batch_size: int,
                     seed: int) -> PackedDocuments:
    """The packed stream over tokenized `documents`, as data.* says."""
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    return PackedDocuments(documents, seq_len, batch_size, seed, cfg.pack, long_docs_policy(cfg, fmt), pad_id)


def nothing_to_train(cfg: DataConfig, fmt: str, stats: DataStats, document_targets: int) -> str:
    """The line refusing data whose rows train no token: the file, the count, and the setting that would help
    (`document_targets`: the targets the documents hold before they are cut into rows of seq_len)."""
    if stats.seq_len < 2:
        fix = f"a row of seq_len={stats.seq_len} token predicts nothing: raise seq_len"
    elif not document_targets and fmt == "chat" and cfg.loss_on != "all":
        fix = (f"no record has an assistant reply to train on (data.loss_on={cfg.loss_on} trains only those): add "
               f"assistant turns, or set data.loss_on=all to train on every token")
    elif stats.long_docs.dropped:
        fix = (f"the documents with tokens to train on are longer than seq_len={stats.seq_len} and dropped: raise "
               f"seq_len or set data.long_docs=truncate")
    else:
        fix = "each document's trained tokens start its row, where they predict nothing: raise seq_len"
    return (f"data.path={cfg.path!r}: 0 of its {stats.tokens:,} tokens in {stats.documents:,} documents would be "
            f"trained on: {fix}")


def build_file_source(cfg: DataConfig, seq_len: int, batch_size: int, seed: int, vocab_size: int,
                      tokenizer_path: str, trained_context: int | None = None,
                      held_out: float = 0.0) -> PackedDocuments:
    """The training stream. `held_out` (eval.fraction) leaves that fraction of the documents out
    (data.documents.split_documents), which changes the documents' content hash, so a resume with another
    fraction is refused as other data."""
    documents, fmt, tokenizer = tokenized_documents(cfg, cfg.path, vocab_size, tokenizer_path)
    if held_out:
        documents = documents.select(split_documents(len(documents), held_out)[0])
    stream = packed_documents(documents, cfg, fmt, tokenizer, seq_len, batch_size, seed)
    log.info(stream.stats.line())
    if not stream.stats.targets:
        raise DataError(nothing_to_train(cfg, fmt, stream.stats, int(int_column(documents, "targets").sum())))
    if warning := stream.stats.padding_warning():
        log.warning(warning)
    if trained_context is not None and trained_context < seq_len:
        log_positions_beyond(documents, seq_len, long_docs_policy(cfg, fmt), trained_context)
    return stream
