"""`LossSums`: the one accumulator of the loop, for the train log window, the epoch's training loss and validation.

A mean over windows of all ranks is exact only as (sum over windows of loss * n) / (sum of n), all-reduced once,
not a mean of per-batch or per-rank means (batches and ranks hold different numbers of windows). The sums stay on
the device in float64, so adding a batch costs no host sync; `reduce()` does the one all-reduce.

    sums = LossSums(stage.part_names, device)
    sums.add(loss, parts, n=x.shape[0])                 # every micro-batch
    totals = sums.reduce()                              # all ranks: totals.mean("loss"), totals.windows
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .distributed import all_reduce_sum

__all__ = ["LossSums", "ReducedSums"]


@dataclass(frozen=True)
class ReducedSums:
    """All ranks' totals of a `LossSums`, on the host."""

    sums: dict[str, float]
    """"loss" and each part name -> sum over windows of value * windows in its batch."""
    windows: int
    """Windows added on all ranks."""
    extra: tuple[float, ...] = ()
    """The `extra` numbers passed to `reduce`, summed over ranks."""

    def mean(self, name: str) -> float:
        """Window-weighted mean of `name` ("loss" or a part); NaN when no window was added."""
        return self.sums[name] / self.windows if self.windows > 0 else math.nan

    def means(self, prefix: str = "") -> dict[str, float]:
        """{prefix + name: mean} for "loss" and every part."""
        return {f"{prefix}{name}": self.mean(name) for name in self.sums}


class LossSums:
    """Per-rank running sums of loss * n, part * n and n.

    Parameters
    ----------
    part_names: names of the loss parts, in the order `add` reads them from its `parts` dict.
    device: where the sums live (the training device: no host sync per batch).
    loss_sum, windows: starting values (a resumed epoch carries what it had summed before the interruption; give
        them on one rank only, since `reduce` sums over ranks).
    """

    def __init__(self, part_names: Sequence[str], device: torch.device, loss_sum: float = 0.0, windows: int = 0):
        self.names = ("loss", *part_names)
        # (1 + n_parts + 1,) float64: loss, parts..., windows
        self.totals = torch.zeros(len(self.names) + 1, dtype=torch.float64, device=device)
        self.totals[0] = loss_sum
        self.totals[-1] = windows

    def add(self, loss: torch.Tensor, parts: dict[str, torch.Tensor], n: int) -> None:
        """Add a batch of `n` windows whose mean loss is `loss` (scalar) and mean parts `parts` (scalars)."""
        values = torch.stack([loss.detach().double(), *[parts[k].detach().double() for k in self.names[1:]]])
        self.totals[:-1] += values * n
        self.totals[-1] += n

    def reduce(self, extra: Sequence[float] = ()) -> ReducedSums:
        """Sum over all ranks (one all-reduce, `extra` host numbers included); the running sums are unchanged."""
        extra_t = torch.tensor(list(extra), dtype=torch.float64, device=self.totals.device)
        totals = all_reduce_sum(torch.cat([self.totals, extra_t])).tolist()
        k = len(self.names)
        return ReducedSums(sums=dict(zip(self.names, totals[:k])), windows=int(totals[k]),
                           extra=tuple(totals[k + 1:]))
