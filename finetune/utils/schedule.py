"""The loop's small pure decisions: early stopping, when to log and checkpoint, how an epoch splits into steps.

Pure functions of numbers (no tensors, no I/O), unit-tested in tests/test_engine_decisions.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .data.window_dataset import batches_per_epoch

__all__ = [
    "EarlyStopping",
    "update_early_stopping",
    "should_save_checkpoint",
    "should_log",
    "micro_batch_sizes",
    "optimizer_steps_per_epoch",
    "step_batch_sizes",
]


@dataclass(frozen=True)
class EarlyStopping:
    """Early-stopping state after one validation."""

    best: float
    """Best validation loss so far."""
    bad_epochs: int
    """Validations in a row without improvement."""
    improved: bool
    """This validation beat the best (save the model)."""
    stop: bool
    """Patience is used up: stop training."""


def update_early_stopping(
    best: float, bad_epochs: int, val_loss: float, patience: int, min_delta: float = 0.0
) -> EarlyStopping:
    """Fold one validation loss into the early-stopping state; `patience=0` never stops. NaN never improves."""
    improved = math.isfinite(val_loss) and val_loss < best - min_delta
    if improved:
        best, bad_epochs = val_loss, 0
    else:
        bad_epochs += 1
    stop = patience > 0 and bad_epochs >= patience
    return EarlyStopping(best=best, bad_epochs=bad_epochs, improved=improved, stop=stop)


def should_save_checkpoint(step: int, every: int) -> bool:
    """Write last.pt after optimizer step `step` (mid-epoch)? Every `every` steps; 0 disables."""
    return every > 0 and step > 0 and step % every == 0


def should_log(step: int, every: int, last_step_of_epoch: bool) -> bool:
    """Write a training record after optimizer step `step`? Every `every` steps and at the end of an epoch."""
    return last_step_of_epoch or (every > 0 and step % every == 0)


def micro_batch_sizes(samples: int, batch_size: int) -> list[int]:
    """Sizes of the epoch's micro-batches on one rank: full batches, then a possibly smaller last one."""
    full, rest = divmod(samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def optimizer_steps_per_epoch(samples_per_rank: int, batch_size: int, accumulation_steps: int) -> int:
    """Optimizer steps in one epoch (the last step may accumulate fewer micro-batches)."""
    return math.ceil(batches_per_epoch(samples_per_rank, batch_size) / accumulation_steps)


def step_batch_sizes(batch_sizes: list[int], step_in_epoch: int, accumulation_steps: int) -> list[int]:
    """Sizes of the micro-batches that make up optimizer step `step_in_epoch` (0-based) of an epoch on one rank.

    Parameters
    ----------
    batch_sizes: the epoch's micro-batch sizes on this rank (`micro_batch_sizes`).
    step_in_epoch: 0-based optimizer step within the epoch.
    accumulation_steps: micro-batches per optimizer step; the epoch's last step may get fewer.
    Returns the sizes, e.g. [4, 4] or, at the end of an epoch, [4, 2] or [2]; empty past the epoch's end.
    """
    return batch_sizes[step_in_epoch * accumulation_steps : (step_in_epoch + 1) * accumulation_steps]
