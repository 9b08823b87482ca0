"""The training entry points both pipelines call: `train_tokenizer`, `train_predictor` and their validation losses.

    with distributed_context(cfg.training.dist_timeout_s) as dist:
        with seeded_init(cfg.training.seed):                             # from-scratch weights, reproducibly
            tokenizer = build_tokenizer(...)
        result = train_tokenizer(tokenizer, train_set, val_set, cfg.training, out_dir, dist,
                                 run_config=config_to_dict(cfg), data_info=data_info)
        result = train_predictor(predictor, tokenizer, train_set, val_set, cfg.training, out_dir, dist, ...)

`train_set` / `val_set` are datasets of `(x, x_stamp)` items (normally `WindowDataset`): x float32 (T, F),
x_stamp int64 (T, 5). Everything the loop writes goes into `output_dir`, from rank 0 only:

    best_model/           save_pretrained folder of the best epoch (config.json + model.safetensors; the
                          predictor's also holds tokenizer_config.json); loads with from_pretrained
    checkpoints/last.pt   resumable state: model, optimizer, scheduler, step, RNG states, config (atomic write)
    metrics.jsonl         one JSON object per logged step and per validation
    loss_curve.png        train and validation loss against the optimizer step
    run_info.json         resolved config, library versions, git commit, training data (also in best_model/)

One optimizer step = `accumulation_steps` micro-batches of `batch_size` windows on each of `world_size` ranks.
The learning rate follows OneCycleLR, stepped once per optimizer step.

This module is the public face of the engine; the pieces live beside it, one concept per file:
    training_config.py  TrainingConfig, validate_training_config, resume compatibility
    stages.py           tokenizer_loss, predictor_loss, the two Stages (loss, clip, loss parts, best-model saving)
    schedule.py         pure decisions: early stopping, when to log / checkpoint, micro-batch sizes
    loss_sums.py        the one loss accumulator (log window, epoch loss, validation)
    trainer.py          Trainer: the loop;  run_state.py: LoopState (last.pt "loop") and TrainResult
    seeding.py, faults.py, logging_setup.py: process-wide helpers
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .distributed import DistInfo
from .faults import FAULT_ENV
from .schedule import (
    EarlyStopping,
    micro_batch_sizes,
    optimizer_steps_per_epoch,
    should_log,
    should_save_checkpoint,
    update_early_stopping,
)
from .stages import (
    PREDICTOR_CLIP,
    TOKENIZER_CLIP,
    PredictorStage,
    TokenizerStage,
    predictor_loss,
    tokenizer_loss,
)
from .run_state import TrainResult
from .trainer import Trainer, evaluate, val_sampler
from .training_config import TrainingConfig, validate_training_config

__all__ = [
    "TrainingConfig",
    "TrainResult",
    "EarlyStopping",
    "train_tokenizer",
    "train_predictor",
    "evaluate_tokenizer",
    "evaluate_predictor",
    "tokenizer_loss",
    "predictor_loss",
    "validate_training_config",
    "update_early_stopping",
    "should_save_checkpoint",
    "should_log",
    "optimizer_steps_per_epoch",
    "micro_batch_sizes",
    "FAULT_ENV",
    "TOKENIZER_CLIP",
    "PREDICTOR_CLIP",
]


def train_tokenizer(
    tokenizer: nn.Module,
    train_set: Dataset,
    val_set: Dataset,
    cfg: TrainingConfig,
    output_dir: str | Path,
    dist: DistInfo,
    *,
    run_config: dict[str, Any] | None = None,
    data_info: dict[str, Any] | None = None,
) -> TrainResult:
    """Finetune the BSQ tokenizer on x (B, T, F) windows; the best epoch is saved with save_pretrained.

    Args:
        tokenizer: a KronosTokenizer (e.g. from_pretrained); moved to `dist.device` and trained in place.
        train_set, val_set: datasets of (x, x_stamp) items (stamps are not used by the tokenizer).
        cfg: loop settings; clip_grad_norm defaults to 2.0.
        output_dir: this stage's output folder (see module docstring).
        dist: from `distributed_context()`.
        run_config: the pipeline's resolved config (stored in run_info.json and the checkpoint).
        data_info: description of the training data for run_info.json (files, sha256, rows, date ranges).
    """
    trainer = Trainer(TokenizerStage(tokenizer), train_set, val_set, cfg, Path(output_dir), dist, run_config, data_info)
    return trainer.fit()


def train_predictor(
    predictor: nn.Module,
    tokenizer: nn.Module,
    train_set: Dataset,
    val_set: Dataset,
    cfg: TrainingConfig,
    output_dir: str | Path,
    dist: DistInfo,
    *,
    run_config: dict[str, Any] | None = None,
    data_info: dict[str, Any] | None = None,
) -> TrainResult:
    """Finetune the Kronos predictor on tokens of the frozen `tokenizer`; the best epoch is saved with
    save_pretrained plus the tokenizer's config (tokenizer_config.json). Arguments as in `train_tokenizer`;
    clip_grad_norm defaults to 3.0; `cfg.teacher_forcing` picks the s2 conditioning used in training."""
    tokenizer.to(dist.device).eval().requires_grad_(False)
    stage = PredictorStage(predictor, tokenizer, cfg.teacher_forcing)
    return Trainer(stage, train_set, val_set, cfg, Path(output_dir), dist, run_config, data_info).fit()


@torch.no_grad()
def evaluate_tokenizer(
    tokenizer: nn.Module, dataset: Dataset, cfg: TrainingConfig, dist: DistInfo, epoch: int = 0
) -> dict[str, float]:
    """Tokenizer loss averaged over validation windows (all ranks), e.g. {"val_loss": .., "val_recon": ..}."""
    stage = TokenizerStage(tokenizer.to(dist.device))
    return evaluate(stage, tokenizer, dataset, val_sampler(dataset, cfg, dist), cfg, dist, epoch)


@torch.no_grad()
def evaluate_predictor(
    predictor: nn.Module, tokenizer: nn.Module, dataset: Dataset, cfg: TrainingConfig, dist: DistInfo, epoch: int = 0
) -> dict[str, float]:
    """Causal, teacher-forced predictor loss averaged over validation windows (all ranks)."""
    tokenizer.to(dist.device).eval()
    stage = PredictorStage(predictor.to(dist.device), tokenizer, True)
    return evaluate(stage, predictor, dataset, val_sampler(dataset, cfg, dist), cfg, dist, epoch)
