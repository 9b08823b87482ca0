"""Validation of one stage (after torchtitan's components/validate.py): `Validator.validate_and_select` = the
validation loss, the pipeline's forecast metric, best-model selection and early stopping, as one `Selection`. Also
what training shares with it: `LossSums`, `rng_fork`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from finetune.utils.checkpoint import rng_state, set_rng_state
from finetune.utils.distributed import DistInfo, all_reduce_sum
from finetune.utils.precision import Precision
from finetune.utils.schema import TrainingConfig
from finetune.utils.windows import EpochSampler, make_loader

# the predictor -> {"score": lower is better, other named values...}; called on every rank after validation, its
# random draws forked off the training's (rng_fork).
ValMetric = Callable[[nn.Module], dict[str, float]]


@dataclass(frozen=True)
class ReducedSums:
    """All ranks' totals of a `LossSums`, on the host."""

    sums: dict[str, float]  # "loss" and each part name -> sum over windows of value * windows in its batch.
    windows: int  # Windows added on all ranks.
    extra: tuple[float, ...] = ()  # The `extra` numbers passed to `reduce`, summed over ranks.

    def mean(self, name: str) -> float:
        """Window-weighted mean of `name` ("loss" or a part); NaN when no window was added."""
        return self.sums[name] / self.windows if self.windows > 0 else math.nan

    def means(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{name}": self.mean(name) for name in self.sums}


class LossSums:
    """Per-rank running sums of loss * n, part * n and n, on the training `device` (no host sync per batch).
    `loss_sum` / `windows` start a resumed epoch where it was interrupted (give them on one rank only: `reduce`
    sums over ranks)."""

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
        return ReducedSums(sums=dict(zip(self.names, totals[:k])), windows=int(totals[k]), extra=tuple(totals[k + 1:]))


@dataclass(frozen=True)
class Selection:
    """One validation's record: the early-stopping state after it and what it measured (`values`: val_loss,
    val_<part>, val_windows, metric_<name> with a forecast metric, score: what training.select_by compares)."""

    best: float  # Best score so far.
    bad_epochs: int  # Validations in a row without improvement.
    improved: bool  # This validation beat the best (save the model: it becomes best_model/).
    stop: bool  # Patience is used up: stop training.
    values: dict[str, Any] = field(default_factory=dict)


def update_early_stopping(best: float, bad_epochs: int, val_loss: float, patience: int,
                          min_delta: float = 0.0) -> Selection:
    """Fold one validation loss into the early-stopping state; `patience=0` never stops. NaN never improves."""
    improved = math.isfinite(val_loss) and val_loss < best - min_delta
    if improved:
        best, bad_epochs = val_loss, 0
    else:
        bad_epochs += 1
    stop = patience > 0 and bad_epochs >= patience
    return Selection(best=best, bad_epochs=bad_epochs, improved=improved, stop=stop)


@contextlib.contextmanager
def rng_fork() -> Iterator[None]:
    """Run a block without moving this process's random streams (python, numpy, torch): epoch-0 validation and
    forecast metrics must not change the training's dropout / sampling."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


def val_sampler(dataset: Dataset, cfg: TrainingConfig, dist: DistInfo) -> EpochSampler:
    """Ordered, nothing dropped or duplicated (an exact loss); a capped run draws a seeded subset per epoch."""
    return EpochSampler(len(dataset), shuffle=False, seed=cfg.seed + 1, max_samples=cfg.max_val_samples,
                        rank=dist.rank, world_size=dist.world_size, drop_remainder=False)


@torch.no_grad()
def evaluate(stage: Any, wrapped: nn.Module, dataset: Dataset, sampler: EpochSampler, cfg: TrainingConfig,
             dist: DistInfo, epoch: int, precision: Precision) -> dict[str, float]:
    """Validation loss of `stage` over every window `sampler` deals (all ranks), in eval mode.

    Returns {"val_loss", "val_<part>" for each of stage.part_names, "val_windows"}: window-weighted means over all
    ranks (sums and counts all-reduced, not batch means). A rank with no window still joins the all-reduce."""
    was_training = stage.model.training
    stage.model.eval()
    loader = make_loader(dataset, sampler, cfg.batch_size, epoch=epoch, seed=cfg.seed + 1, num_workers=cfg.num_workers,
                         pin_memory=dist.device.type == "cuda")
    sums = LossSums(stage.part_names, dist.device)
    for x, stamp in loader:
        # x (B, T, F), stamp (B, T, 5)
        x, stamp = x.to(dist.device, non_blocking=True), stamp.to(dist.device, non_blocking=True)
        with precision.autocast():
            loss, parts = stage.loss(wrapped, x, stamp, training=False)
        sums.add(loss, parts, x.shape[0])
    totals = sums.reduce()
    stage.model.train(was_training)
    return {**totals.means(prefix="val_"), "val_windows": totals.windows}


class Validator:
    """Validates one stage: `stage` (its model, loss and part names), `val_set`, the loop settings `cfg`
    (batch_size, seed, max_val_samples, patience, min_delta, select_by), the run's `precision` and the pipeline's
    forecast metric (None: select by the validation loss)."""

    def __init__(self, stage: Any, val_set: Dataset, cfg: TrainingConfig, dist: DistInfo, precision: Precision,
                 val_metric: ValMetric | None = None):
        self.stage, self.val_set, self.cfg, self.dist = stage, val_set, cfg, dist
        self.precision, self.val_metric = precision, val_metric
        self.sampler = val_sampler(val_set, cfg, dist)

    def validate_and_select(self, wrapped: nn.Module, epoch: int, best_score: float, bad_epochs: int) -> Selection:
        """Validate after `epoch` (0 = the starting model) through `wrapped` (the model or its DDP wrapper) and
        decide against the best score so far and the early-stopping count."""
        cfg = self.cfg
        # The sampler's epoch (a fresh subset per epoch under max_val_samples): epoch 0 shares epoch 1's.
        values = evaluate(self.stage, wrapped, self.val_set, self.sampler, cfg, self.dist, max(epoch - 1, 0),
                          self.precision)
        score = values["val_loss"]
        if self.val_metric is not None:
            with rng_fork():  # a sampled forecast metric must not move the training's random streams
                metric = self.val_metric(self.stage.model)
            values.update({f"metric_{k}": float(v) for k, v in metric.items()})
            if cfg.select_by != "loss":
                score = float(metric["score"])
        decision = update_early_stopping(best_score, bad_epochs, score, cfg.patience, cfg.min_delta)
        # No stop, and no bad epoch counted, after the starting model's validation.
        return replace(decision, bad_epochs=0 if epoch == 0 else decision.bad_epochs, stop=decision.stop and epoch > 0,
                       values={**values, "score": score})
