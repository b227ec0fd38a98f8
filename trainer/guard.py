"""The NaN/Inf guard: a step whose loss or gradients are not finite is skipped (never applied, never
checkpointed) and counted; too many in a row stop the job."""
from __future__ import annotations

import math
from pathlib import Path


class BadStepsError(RuntimeError):
    """Training stopped because the loss or gradients stayed non-finite for too many consecutive steps."""


def update_is_finite(loss: float, grad_norm: float) -> bool:
    """Whether a step's update may be applied. Every optimizer path calls this before changing weights
    (the gradient norm is non-finite as soon as any gradient element is)."""
    return math.isfinite(loss) and math.isfinite(grad_norm)


class BadStepCounter:
    """Counts skipped steps and raises BadStepsError after `limit` (max_bad_steps, at least 1) consecutive
    ones."""

    def __init__(self, limit: int, skipped_before: int = 0):
        self.limit, self.skipped, self.consecutive = limit, skipped_before, 0

    def record(self, applied: bool) -> None:
        if applied:
            self.consecutive = 0
        else:
            self.skipped += 1
            self.consecutive += 1

    @property
    def exhausted(self) -> bool:
        return self.consecutive >= self.limit

    def stop(self, step: int, last_good: Path | None) -> None:
        """Raise BadStepsError after `step`, naming `last_good`: a checkpoint whose files were verified
        against their checksums (CheckpointManager.last_good), or None when there is none."""
        where = (f"the last good checkpoint is {last_good} (resume=<that path>, perhaps with a lower "
                 f"optim.lr)" if last_good else "no verified checkpoint was written yet")
        raise BadStepsError(
            f"loss or gradients were NaN/Inf for {self.consecutive} consecutive steps "
            f"({step - self.consecutive + 1}-{step}; limit max_bad_steps={self.limit}); none of them was "
            f"applied; {where}")
