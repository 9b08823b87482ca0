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
                          predictor's also holds tokenizer_config.json); loads with from_pretrained. Epoch 0 =
                          the starting model, validated before the first step, kept unless an epoch beats it
    checkpoints/step-XXXXXXXX.pt  the newest `training.keep_checkpoints` resumable states (model, optimizer,
                          schedule, step, RNG states, config, data fingerprint), written atomically
    checkpoints/last.pt   hard link to the newest step file
    metrics.jsonl         one JSON object per logged step and per validation (epoch 0 first)
    loss_curve.png        train and validation loss against the optimizer step
    run_info.json         resolved config, library versions, git commit, training data (also in best_model/);
                          "result": {"finished": true, ...} once the run is complete
    run.lock              present while a run holds the folder (rank 0; released at the end)

Run safety (issue 8), all in the engine: a folder holding an unfinished run is resumed (training.resume=auto), a
finished one is skipped (`TrainResult.skipped`; `stage_status(folder)` says which without training) unless
training.overwrite=true; SIGTERM/SIGINT finish the step, save and raise `TrainingStopped` (exit code 75); a
non-finite loss/gradient raises `DivergenceError` before the update; a second run into a locked folder raises
`RunLockedError`; a full disk raises `CheckpointWriteError` (OSError). The entry points turn these into one line.

What `data_info` must hold (it is fingerprinted into every checkpoint, and a resume on different data is refused
unless training.accept_changed_data=true): everything that decides which windows the run trains on, as JSON-able
values - the input files with their sha256 (provenance.file_fingerprint), each split's row count and first/last
timestamp (or row range), lookback, predict, stride, clip, feature columns and any sampling caps. Nothing that
varies between identical runs (absolute temp paths, times).

One optimizer step = `accumulation_steps` micro-batches of `batch_size` windows on each of `world_size` ranks.
The learning rate follows OneCycleLR, stepped once per optimizer step.

This module is the public face of the engine; the pieces live beside it, one concept per file:
    training_config.py  TrainingConfig, validate_training_config, resume compatibility
    stages.py           tokenizer_loss, predictor_loss, the two Stages (loss, clip, loss parts, best-model saving)
    schedule.py         pure decisions: early stopping, when to log / checkpoint, micro-batch sizes
    loss_sums.py        the one loss accumulator (log window, epoch loss, validation)
    trainer.py          Trainer: the loop;  run_state.py: LoopState (last.pt "loop") and TrainResult
    stage_folder.py     stage_status, the resume / skip / overwrite / refuse decision, data & weight fingerprints
    resume.py           rank-0 decisions broadcast, checkpoint choice, what a resume may change
    run_lock.py, interrupts.py, guard.py, checkpoint_store.py: the run-safety pieces the trainer wires in
    seeding.py, faults.py, logging_setup.py: process-wide helpers
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .distributed import DistInfo
from .run_state import TrainResult
from .safety.faults import FAULT_ENV
from .safety.stage_folder import stage_status
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
from .trainer import Trainer, ValMetric, evaluate, val_sampler
from .training_config import TrainingConfig, validate_training_config

__all__ = [
    "TrainingConfig",
    "TrainResult",
    "stage_status",
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
    val_metric: ValMetric | None = None,
    data_extremes: str | None = None,
) -> TrainResult:
    """Finetune the BSQ tokenizer on x (B, T, F) windows; the best epoch is saved with save_pretrained.

    Args:
        tokenizer: a KronosTokenizer (e.g. from_pretrained); moved to `dist.device` and trained in place.
        train_set, val_set: datasets of (x, x_stamp) items (stamps are not used by the tokenizer).
        cfg: loop settings; clip_grad_norm defaults to 2.0.
        output_dir: this stage's output folder (see module docstring).
        dist: from `distributed_context()`.
        run_config: the pipeline's resolved config (stored in run_info.json and the checkpoint).
        data_info: description of the training data (see "What data_info must hold" above).
        val_metric: optional forecast metric (model, stage) -> {"score": lower is better, ...} run after every
            validation on every rank; picks best_model/ when training.select_by names it.
        data_extremes: what the pipeline's data check flagged (quoted when training diverges), or None.
    """
    trainer = Trainer(TokenizerStage(tokenizer), train_set, val_set, cfg, Path(output_dir), dist, run_config, data_info,
                      val_metric=val_metric, data_extremes=data_extremes)
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
    val_metric: ValMetric | None = None,
    data_extremes: str | None = None,
    forecast_info: dict[str, Any] | None = None,
) -> TrainResult:
    """Finetune the Kronos predictor on tokens of the frozen `tokenizer`; the best epoch is saved with
    save_pretrained plus the tokenizer's config (tokenizer_config.json). Arguments as in `train_tokenizer`;
    clip_grad_norm defaults to 3.0; `cfg.teacher_forcing` picks the s2 conditioning used in training.
    `forecast_info` ({"max_context", "tokenizer", "clip"}, see model.predictor_files) is written beside the best
    model as kronos_predictor.json, so `KronosPredictor.from_pretrained(best_model/)` loads the whole forecaster."""
    tokenizer.to(dist.device).eval().requires_grad_(False)
    stage = PredictorStage(predictor, tokenizer, cfg.teacher_forcing, forecast_info)
    return Trainer(stage, train_set, val_set, cfg, Path(output_dir), dist, run_config, data_info,
                   val_metric=val_metric, data_extremes=data_extremes).fit()


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
