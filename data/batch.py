"""The unit every data source yields and the trainer consumes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class Batch:
    input_ids: torch.Tensor              # [B, S] int64
    labels: torch.Tensor                 # [B, S] int64, already shifted: labels[t] is predicted at t
    position_ids: torch.Tensor           # [B, S] int64, restarting at 0 per document
    cu_seqlens: torch.Tensor | None = None  # int32 document offsets over the flattened B*S tokens

    def to(self, device: torch.device | str) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids), move(self.cu_seqlens))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())
