"""Passkey retrieval haystacks: a random number hidden at a chosen depth of filler text, asked for at the end.

Each haystack is one document of a given length: an instruction, filler, the key's sentence at the whole
token nearest `depth` of the filler (0: right after the instruction, 1: right before the question; the depth
placed is what the figures name), more filler, the question, and the key's tokens as the answer, which are
the document's only targets. Haystacks of all (length, depth, trial) cells
are packed into rows of seq_len like training data (data.packing), so one forward pass scores many of them;
`PasskeyGrid.cells` says which cell each target belongs to. Whether greedy decoding would answer the key
exactly is whether the argmax at every answer position is the key's token, which one teacher-forced forward
pass tells (trainer.evaluate). Keys come from a fixed seed: every evaluation asks for the same keys.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import torch

from data.batch import IGNORE_INDEX, Batch, sequence_slice
from data.packing import Document, assemble_batch, pack_rows
from data.tokenize import DataError

INSTRUCTION = ("Somewhere in the long text below a pass key is hidden. Read all of it and remember the pass key: "
               "you will be asked for it at the end.\n")
# Built-in filler, repeated as long as needed; the key's sentence goes in at a token boundary.
FILLER = ("The river bends slowly past the old mill, and the fields beside it lie quiet under a pale sky. "
          "A cart rolls along the lane toward the village, where the bells ring out the hour. ")
NEEDLE = " The pass key is {key}. Remember it: {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
KEY_DIGITS = 5
KEY_SEED = 39
# Haystack lengths when eval.passkey.lengths is not given: seq_len and its halvings, at most this many.
DEFAULT_LENGTHS = 4
# The fewest filler tokens a haystack holds: below it there is hardly a haystack, and its depths would not be
# distinct positions.
MIN_FILLER = 32


def grid_lengths(seq_len: int, count: int) -> list[int]:
    """seq_len and the `count` - 1 halvings below it, shortest first."""
    return [seq_len >> shift for shift in reversed(range(count))]


def haystack_lengths(seq_len: int, count: int | None, shortest: int) -> list[int]:
    """The probe's haystack lengths, shortest first: `count` of them (grid_lengths), or for None seq_len and
    its halvings down to `shortest` (the shortest haystack the tokenizer allows), at most DEFAULT_LENGTHS."""
    if count is not None:
        return grid_lengths(seq_len, count)
    return [length for length in grid_lengths(seq_len, DEFAULT_LENGTHS) if length >= shortest]


def passkey_keys(count: int) -> list[str]:
    """The first `count` keys, the same at every evaluation: one per haystack, in (length, depth, trial) order."""
    draw = random.Random(KEY_SEED)
    return [str(draw.randrange(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS)) for _ in range(count)]


def check_haystack_lengths(lengths: list[int], count: int | None, seq_len: int, shortest: int) -> None:
    """DataError when a haystack of `lengths` (eval.passkey.lengths=`count`) is shorter than `shortest` tokens."""
    if lengths and lengths[0] < shortest:
        fits = len(haystack_lengths(seq_len, None, shortest)) if seq_len >= shortest else 0
        fix = (f"set eval.passkey.lengths={fits} or fewer, or leave it unset (derived from seq_len)" if fits else
               f"raise seq_len to {shortest} or more, or set eval.passkey.lengths=0 (no passkey probe)")
        raise DataError(f"eval.passkey.lengths={count} at seq_len={seq_len} makes a haystack of {lengths[0]} tokens, "
                        f"and one needs {shortest} with this tokenizer (the instruction, key and question, and "
                        f"{MIN_FILLER} of filler): {fix}")


def grid_depths(count: int) -> list[float]:
    """`count` depths evenly from 0 to 1 (0.5 alone for one)."""
    return [0.5] if count == 1 else [index / (count - 1) for index in range(count)]


@dataclass
class PasskeyGrid:
    """The probe's packed rows: `batches` of seq_len rows (labels only at the answers' positions) and, per
    batch, `cells` [B, S]: the cell index (length, depth, trial in that order) of each answer position, -1
    elsewhere."""
    lengths: list[int]
    depths: list[float]
    trials: int
    batches: list[Batch]
    cells: list[torch.Tensor]
    # Per cell, the depth its key was placed at (a whole token: near `depths` in long haystacks only).
    placed: list[float] = dataclasses.field(default_factory=list)

    @property
    def cell_count(self) -> int:
        return len(self.lengths) * len(self.depths) * self.trials

    def shard(self, position: int, index: int, count: int) -> tuple[Batch, torch.Tensor]:
        """Batch `position` and its cells, sliced for sequence-parallel rank `index` of `count`."""
        part = sequence_slice(self.cells[position].shape[1], index, count)
        return self.batches[position].shard(index, count), self.cells[position][:, part]


class HaystackParts:
    """The tokenized pieces every haystack is made of, with the run's tokenizer."""

    def __init__(self, tokenizer, filler: list[int] | None):
        self.tokenizer = tokenizer
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.start = bos + self.encode(INSTRUCTION)
        self.filler = filler or self.encode(FILLER)
        self.question = self.encode(QUESTION)
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def fixed(self, key: str) -> int:
        """The tokens of a haystack for `key` that are not filler."""
        needle, answer = self.encode(NEEDLE.format(key=key)), self.encode(ANSWER.format(key=key))
        return len(self.start) + len(needle) + len(self.question) + len(answer)

    def shortest(self, keys: list[str]) -> int:
        """The shortest haystack for every one of `keys`: its fixed tokens and MIN_FILLER of filler."""
        return max(self.fixed(key) for key in keys) + MIN_FILLER

    def split(self, length: int, depth: float, key: str) -> tuple[int, int]:
        """(filler tokens before the key, filler tokens) of the haystack: the key at the whole token nearest
        `depth` of the filler."""
        room = length - self.fixed(key)
        if room < MIN_FILLER:
            raise DataError(f"a passkey haystack of {length} tokens is too short: it needs {self.fixed(key)} for its "
                            f"instruction, key and question and {MIN_FILLER} of filler (set fewer "
                            f"eval.passkey.lengths)")
        return round(depth * room), room

    def haystack(self, length: int, depth: float, key: str) -> Document:
        """A document of exactly `length` tokens whose targets are the key's tokens at its end."""
        needle, answer = self.encode(NEEDLE.format(key=key)), self.encode(ANSWER.format(key=key))
        split, room = self.split(length, depth, key)
        filler = (self.filler * (room // len(self.filler) + 1))[:room]
        ids = self.start + filler[:split] + needle + filler[split:] + self.question + answer
        return ids, [False] * (len(ids) - len(answer)) + [True] * len(answer)


def passkey_lengths(tokenizer, seq_len: int, lengths: int | None, depths: int, trials: int) -> list[int]:
    """The haystack lengths of the probe (haystack_lengths), checked against the shortest haystack this
    tokenizer allows (DataError naming eval.passkey.lengths); read before anything is built."""
    parts = HaystackParts(tokenizer, None)
    shortest = parts.shortest(passkey_keys((lengths or DEFAULT_LENGTHS) * depths * trials))
    chosen = haystack_lengths(seq_len, lengths, shortest)
    check_haystack_lengths(chosen, lengths, seq_len, shortest)
    return chosen


def passkey_grid(tokenizer, seq_len: int, batch_size: int, lengths: int | None, depths: int, trials: int,
                 filler: list[int] | None = None, multiple_of: int = 1) -> PasskeyGrid:
    """Every (length, depth, trial) haystack, packed into batches of `batch_size` rows of seq_len, their
    number padded with empty batches to a multiple of `multiple_of` (one share per data-parallel group).
    lengths: how many (None: passkey_lengths derives them from seq_len); filler: the text's token ids
    (held-out documents), or None for the built-in filler."""
    parts = HaystackParts(tokenizer, filler)
    grid = PasskeyGrid(passkey_lengths(tokenizer, seq_len, lengths, depths, trials), grid_depths(depths), trials,
                       [], [])
    cells = [(length, depth) for length in grid.lengths for depth in grid.depths for _ in range(trials)]
    keys = passkey_keys(len(cells))
    documents = [parts.haystack(length, depth, key) for (length, depth), key in zip(cells, keys)]
    grid.placed = [split / room for split, room in (parts.split(length, depth, key)
                                                    for (length, depth), key in zip(cells, keys))]
    rows = pack_rows(np.array([len(ids) for ids, _ in documents]), seq_len, pack=True)
    rows += [[]] * (-len(rows) % (batch_size * multiple_of))
    for first in range(0, len(rows), batch_size):
        chosen = rows[first:first + batch_size]
        batch = assemble_batch([[documents[cell] for cell in row] for row in chosen], seq_len, parts.pad_id, True)
        grid.batches.append(batch)
        grid.cells.append(answer_cells(chosen, [len(ids) for ids, _ in documents], batch.labels))
    return grid


def answer_cells(rows: list[list[int]], lengths: list[int], labels: torch.Tensor) -> torch.Tensor:
    """[B, S] the cell of each supervised position of rows laid out in order (data.packing.assemble_batch),
    -1 elsewhere."""
    cells = torch.full(labels.shape, -1, dtype=torch.int64)
    for row, documents in enumerate(rows):
        start = 0
        for cell in documents:
            cells[row, start:start + lengths[cell]] = cell
            start += lengths[cell]
    return torch.where(labels != IGNORE_INDEX, cells, -1)
