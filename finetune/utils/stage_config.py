"""Per-stage overrides of the shared `training:` settings (`tokenizer_training:` / `predictor_training:` in YAML).

Both pipelines train a tokenizer and a predictor with one `TrainingConfig`; the few settings that differ between the
two stages (epochs, learning rate, batch size, gradient clip) are given here, null (the default) meaning "as in
`training:`". The shipped configs set the reference learning rates (tokenizer 2e-4, predictor 4e-5) here.

A stage value wins over `training:`, so `--set training.lr=1e-4` does nothing to a stage whose section sets `lr`:
`shadowed_overrides` finds such overrides and the config loaders warn, naming both keys.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .config_utils import Problems
from .training_utils import TrainingConfig

__all__ = ["STAGES", "StageConfig", "apply_stage", "validate_stage", "shadowed_overrides", "warn_shadowed_overrides"]

log = logging.getLogger("finetune.config")

STAGES = ("tokenizer", "predictor")


@dataclass
class StageConfig:
    """What one stage sets differently from `training:`; null = use the `training:` value."""

    epochs: int | None = None
    """Epochs of this stage; null = training.epochs (the CSV pipeline also takes 0 = skip this stage)."""
    lr: float | None = None
    """Peak learning rate of this stage; null = training.lr (reference finetuning: 2e-4 tokenizer, 4e-5 predictor)."""
    batch_size: int | None = None
    """Windows per micro-batch on each process; null = training.batch_size."""
    clip_grad_norm: float | None = None
    """Gradient-norm clip; null = training.clip_grad_norm, whose null means 2.0 (tokenizer) / 3.0 (predictor)."""


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


def shadowed_overrides(cfg: Any, overrides: Iterable[str]) -> list[str]:
    """One message per `--set training.X=...` in `overrides` that a stage section of `cfg` shadows (sets X).

    Parameters: cfg: a pipeline config with `tokenizer_training` / `predictor_training` StageConfig sections;
    overrides: the raw `KEY=VALUE` strings. Returns: messages naming both keys (empty when nothing is shadowed).
    """
    stage_fields = {f.name for f in dataclasses.fields(StageConfig)}
    out = []
    for item in overrides or ():
        key = item.partition("=")[0].strip()
        section, _, name = key.partition(".")
        if section != "training" or name not in stage_fields:
            continue
        for stage in STAGES:
            value = getattr(getattr(cfg, f"{stage}_training"), name)
            if value is not None:
                out.append(f"--set {key} does not change the {stage} stage: {stage}_training.{name} = {value} "
                           f"shadows it; set {stage}_training.{name} instead (or set it to null to inherit)")
    return out


def warn_shadowed_overrides(cfg: Any, overrides: Iterable[str]) -> None:
    """Log a warning for each override `shadowed_overrides` finds."""
    for message in shadowed_overrides(cfg, overrides):
        log.warning("%s", message)
