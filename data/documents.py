"""Which documents and positions a run trains on: the held-out split (by document, never by row) and the
share of trained tokens beyond a checkpoint's context (packing keeps documents apart, so a position is
trained only inside a document that long)."""
from __future__ import annotations

import logging

import numpy as np

from data.tokenize import DataError

log = logging.getLogger(__name__)

# Fixed, not the run's seed: runs over the same documents hold out the same ones and evaluate the same rows.
SPLIT_SEED = 39


def split_documents(count: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) document indices, sorted: round(fraction x count) documents (at least one, and
    one left to train on) chosen by a permutation of a fixed seed, so the split depends only on the number
    of documents and the fraction: the same at every resume."""
    if count < 2:
        raise DataError(f"eval.fraction needs at least 2 documents to split off held-out ones; the data has "
                        f"{count}: give held-out files with eval.path instead")
    held = min(count - 1, max(1, round(count * fraction)))
    order = np.random.default_rng(SPLIT_SEED).permutation(count)
    return np.sort(order[held:]), np.sort(order[:held])


def trained_positions(documents, seq_len: int, long_docs: str, context: int) -> tuple[int, int]:
    """(trained tokens, those at positions >= `context`): a token is trained at the position that predicts
    it, counted from its piece's start (packing keeps documents apart, and a document longer than seq_len
    is split into pieces that each start at position 0, truncated or dropped: data.long_docs). Reads the
    trained-on flags chunk by chunk, as content_fingerprint does, and counts them by piece from their running
    sum: one pass over the tokens (about half a second per 100M), the rest per piece."""
    trained = beyond = 0
    for chunk in documents.with_format("arrow", columns=["is_target"])[:].column("is_target").chunks:
        lengths = chunk.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
        flags = chunk.flatten().to_numpy(zero_copy_only=False)
        running = np.zeros(len(flags) + 1, dtype=np.int64)                    # flags before each token
        np.cumsum(flags.view(np.uint8), dtype=np.int64, out=running[1:])      # (from bool: 3x slower)
        kept = {"drop": np.where(lengths <= seq_len, lengths, 0),
                "truncate": np.minimum(lengths, seq_len)}.get(long_docs, lengths)
        pieces = -(-kept // seq_len)
        document = np.repeat(np.arange(len(kept)), pieces)
        index = np.arange(len(document)) - np.repeat(np.cumsum(pieces) - pieces, pieces)   # piece of its document
        start = (np.cumsum(lengths) - lengths)[document] + index * seq_len
        end = start + np.minimum(seq_len, kept[document] - index * seq_len)
        # Position 0 of a piece predicts nothing; position p >= 1 predicts from position p - 1.
        trained += int((running[end] - running[start + 1]).sum())
        beyond += int((running[end] - running[np.minimum(end, start + context + 1)]).sum())
    return trained, beyond


def log_positions_beyond(documents, seq_len: int, long_docs: str, context: int) -> None:
    """The share of trained tokens at positions beyond model.path's context; a warning when there are none,
    since a context extension then trains nothing new."""
    trained, beyond = trained_positions(documents, seq_len, long_docs, context)
    share = beyond / max(trained, 1)
    if beyond:
        log.info("data: %.1f%% of trained tokens (%s) are at positions beyond model.path's context of %d",
                 100 * share, f"{beyond:,}", context)
    else:
        log.warning("data: no trained token is at a position beyond model.path's context of %d (packing keeps "
                    "documents apart, so positions are bounded by the longest document): positions up to seq_len="
                    "%d are never trained; add documents longer than %d tokens (docs/LONG_CONTEXT.md)",
                    context, seq_len, context)
