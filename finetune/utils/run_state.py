"""What a training run remembers (`LoopState`, saved in last.pt as "loop") and what it returns (`TrainResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LoopState", "TrainResult"]


@dataclass
class TrainResult:
    """What a training loop returns."""

    stage: str
    """'tokenizer' or 'predictor'."""
    best_val_loss: float
    """Validation loss (sample-weighted over all validation windows) of the best epoch; inf if none was finite."""
    best_epoch: int | None
    """Epoch of best_model/: 0 = the starting model (validated before the first step), 1.. = trained epochs."""
    output_dir: Path
    """The run's output folder."""
    best_model_dir: Path
    """save_pretrained folder of the best model (exists once one validation improved)."""
    last_checkpoint: Path
    """Resumable checkpoint."""
    metrics_path: Path
    """metrics.jsonl."""
    plot_path: Path | None
    """loss_curve.png (None without matplotlib)."""
    run_info_path: Path
    """run_info.json."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One dict per validation: epoch (0 = the starting model, train_loss None), step, train_loss, val_loss,
    val_<part>, metric_<name> (with a val_metric), score, lr, seconds."""
    global_step: int = 0
    """Optimizer steps done."""
    stopped_early: bool = False
    """True when patience ran out before the last epoch."""
    resumed_from: Path | None = None
    """Checkpoint this run continued from (or read back, when skipped), if any."""
    best_score: float = math.inf
    """The best value of what training.select_by chose (val_loss, or the forecast metric's score)."""
    skipped: bool = False
    """The folder held a finished run: nothing was trained, the result was read from its final checkpoint."""


@dataclass
class LoopState:
    """Everything besides tensors that a resumed run needs to continue exactly (last.pt's "loop" entry)."""

    epoch: int = 0
    """Current epoch (0-based); equals the epoch count once the run is finished."""
    step_in_epoch: int = 0
    """Optimizer steps done in the current epoch."""
    epoch_loss_sum: float = 0.0
    """All ranks' sum of per-window training losses so far in this epoch (as of the last mid-epoch checkpoint)."""
    epoch_windows: int = 0
    """... and the number of windows in that sum."""
    global_step: int = 0
    """Optimizer steps done in the run."""
    best_val_loss: float = math.inf
    """Validation loss of the best epoch so far."""
    best_epoch: int | None = None
    """Best epoch so far (0 = the starting model)."""
    best_score: float = math.inf
    """Best value of the selection score (val_loss or the forecast metric's score) so far."""
    bad_epochs: int = 0
    """Validations in a row without improvement (early stopping)."""
    stopped_early: bool = False
    """Patience ran out before the last epoch."""
    finished: bool = False
    """No epoch left to train."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One entry per validation, epoch 0 (the starting model) first (train and validation loss, lr, seconds)."""
