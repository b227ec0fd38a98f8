"""The unit every data source yields and the trainer consumes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


def sequence_slice(seqlen: int, index: int, count: int) -> slice:
    """The index-th of `count` equal slices of a sequence of `seqlen` tokens (sequence parallelism)."""
    if seqlen % count:
        raise ValueError(f"a sequence of {seqlen} tokens does not split into {count} equal slices")
    return slice(index * seqlen // count, (index + 1) * seqlen // count)


@dataclass
class Batch:
    input_ids: torch.Tensor              # [B, S] int64
    labels: torch.Tensor                 # [B, S] int64, already shifted: labels[t] is predicted at t
    position_ids: torch.Tensor           # [B, S] int64, restarting at 0 per document
    cu_seqlens: torch.Tensor | None = None  # int32 document offsets over the flattened B*S tokens

    def to(self, device: torch.device | str) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids), move(self.cu_seqlens))

    def shard(self, index: int, count: int) -> "Batch":
        """The index-th of `count` equal slices of the sequence (sequence parallelism): its tokens, labels
        and positions; cu_seqlens stay those of the whole sequence, which attention sees."""
        part = sequence_slice(self.input_ids.shape[1], index, count)
        return Batch(self.input_ids[:, part], self.labels[:, part], self.position_ids[:, part], self.cu_seqlens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())
