"""Per-stage overrides of the shared `training:` settings (`tokenizer_training:` / `predictor_training:` in YAML).

Both pipelines train a tokenizer and a predictor with one `TrainingConfig`; the few settings that differ between the
two stages (epochs, learning rate, batch size, gradient clip) are given here, null meaning "as in `training:`".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config_utils import Problems
from .training_utils import TrainingConfig


@dataclass
class StageConfig:
    """What one stage sets differently from `training:`; null = use the `training:` value."""

    epochs: int | None = None
    """Epochs of this stage; null = training.epochs (the CSV pipeline also takes 0 = skip this stage)."""
    lr: float | None = None
    """Peak learning rate of this stage; null = training.lr."""
    batch_size: int | None = None
    """Windows per micro-batch on each process; null = training.batch_size."""
    clip_grad_norm: float | None = None
    """Gradient-norm clip; null = training.clip_grad_norm, whose null means 2.0 (tokenizer) / 3.0 (predictor)."""


@dataclass
class TokenizerStageConfig(StageConfig):
    """Tokenizer-stage overrides of `training:`."""

    lr: float | None = 2e-4
    """Peak learning rate of the tokenizer (reference finetuning: 2e-4); null = training.lr."""


@dataclass
class PredictorStageConfig(StageConfig):
    """Predictor-stage overrides of `training:`."""

    lr: float | None = 4e-5
    """Peak learning rate of the predictor (reference finetuning: 4e-5); null = training.lr."""


def apply_stage(training: TrainingConfig, stage: StageConfig) -> TrainingConfig:
    """`training` with the stage's non-null overrides applied: what the engine runs that stage with."""
    changed = {f.name: getattr(stage, f.name) for f in dataclasses.fields(stage) if getattr(stage, f.name) is not None}
    return dataclasses.replace(training, **changed)


def validate_stage(stage: StageConfig, prefix: str, problems: Problems, min_epochs: int = 1) -> None:
    """Add the problems of one stage's overrides, named `prefix.field` (e.g. `predictor_training.lr`)."""
    e = stage.epochs
    problems.check(e is None or e >= min_epochs, f"{prefix}.epochs", f"must be >= {min_epochs} or null, got {e}")
    problems.check(stage.lr is None or stage.lr > 0, f"{prefix}.lr", f"must be > 0 or null, got {stage.lr}")
    problems.check(stage.batch_size is None or stage.batch_size >= 1, f"{prefix}.batch_size",
                   f"must be >= 1 or null, got {stage.batch_size}")
    problems.check(stage.clip_grad_norm is None or stage.clip_grad_norm >= 0, f"{prefix}.clip_grad_norm",
                   f"must be >= 0 or null, got {stage.clip_grad_norm}")
