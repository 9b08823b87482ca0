"""The training engine both pipelines call (`train_tokenizer`, `train_predictor`): one module, read top to bottom;
`Trainer` declares all its state in `__init__`, and `state_dict()` / `load_state_dict()` are a checkpoint's content.
Its neighbours' roles and what `data_info` must hold: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import finetune.utils.checkpoint as checkpoint_store
from finetune.utils import adapters, ledger, validate
from finetune.utils.config_utils import Problems, config_to_dict, plain
from finetune.utils.distributed import DistInfo, all_gather_object, barrier, no_sync, seed_everything, wrap_model
from finetune.utils.errors import CheckpointWriteError, DivergenceError, TrainingStopped, stage_log
from finetune.utils.metrics import MetricsLogger, read_metrics, write_run_info
from finetune.utils.plots import loss_plot_title, plot_loss_curves
from finetune.utils.precision import forward_flops_per_token, resolve_precision
from finetune.utils.safety import GracefulStop, NonFiniteGuard, RunLock, maybe_die_after_step
from finetune.utils.schema import TrainingConfig, stage_key, validate_training_config
from finetune.utils.windows import EpochSampler, batches_per_epoch, make_loader
from model.config import Window
from model.errors import DataError
from model.fileio import check_seal, seal
from model.hub import weights_fingerprint
from model.predictor import PREDICTOR_INFO_NAME, TOKENIZER_CONFIG_NAME, TOKENIZER_SUBDIR, predictor_info


@dataclass
class TrainResult:
    """What a training loop returns."""

    stage: str  # 'tokenizer' or 'predictor'.
    # Validation loss (sample-weighted over all validation windows) of the best epoch; inf if none was finite.
    best_val_loss: float
    # Epoch of best_model/: 0 = the starting model (validated before the first step), 1.. = trained epochs.
    best_epoch: int | None
    output_dir: Path  # The run's output folder.
    best_model_dir: Path  # save_pretrained folder of the best model (exists once one validation improved).
    last_checkpoint: Path  # Resumable checkpoint.
    metrics_path: Path  # metrics.jsonl.
    plot_path: Path | None  # loss_curve.png (None without matplotlib).
    run_info_path: Path  # run_info.json.
    # One dict per validation: epoch (0 = the starting model, train_loss None), step, train_loss, val_loss, val_<part>,
    # metric_<name> (with a val_metric), score, lr, seconds.
    history: list[dict[str, Any]] = field(default_factory=list)
    global_step: int = 0  # Optimizer steps done.
    stopped_early: bool = False  # True when patience ran out before the last epoch.
    resumed_from: Path | None = None  # Checkpoint this run continued from (or read back, when skipped), if any.
    # The best value of what training.select_by chose (val_loss, or the forecast metric's score).
    best_score: float = math.inf
    # The folder held a finished run: nothing was trained, the result was read from its final checkpoint.
    skipped: bool = False


@dataclass
class LoopState:
    """Everything besides tensors that a resumed run needs to continue exactly (last.pt's "loop" entry)."""

    epoch: int = 0  # Current epoch (0-based); equals the epoch count once the run is finished.
    step_in_epoch: int = 0  # Optimizer steps done in the current epoch.
    # All ranks' sum of per-window training losses so far in this epoch (as of the last mid-epoch checkpoint).
    epoch_loss_sum: float = 0.0
    epoch_windows: int = 0  # ... and the number of windows in that sum.
    global_step: int = 0  # Optimizer steps done in the run.
    best_val_loss: float = math.inf  # Validation loss of the best epoch so far.
    best_epoch: int | None = None  # Best epoch so far (0 = the starting model).
    best_score: float = math.inf  # Best value of the selection score (val_loss or the forecast metric's score) so far.
    bad_epochs: int = 0  # Validations in a row without improvement (early stopping).
    stopped_early: bool = False  # Patience ran out before the last epoch.
    finished: bool = False  # No epoch left to train.
    # One entry per validation, epoch 0 (the starting model) first (train and validation loss, lr, seconds).
    history: list[dict[str, Any]] = field(default_factory=list)


def should_save_checkpoint(step: int, every: int) -> bool:
    """Write last.pt after optimizer step `step` (mid-epoch)? Every `every` steps; 0 disables."""
    return every > 0 and step > 0 and step % every == 0


def should_log(step: int, every: int, last_step_of_epoch: bool) -> bool:
    """Write a training record after optimizer step `step`? Every `every` steps and at the end of an epoch."""
    return last_step_of_epoch or (every > 0 and step % every == 0)


def one_cycle_pct_start(pct_start: float, total_steps: int) -> float:
    """training.pct_start for OneCycleLR over `total_steps`. Its warm-up ends at step pct_start * total_steps - 1
    and it divides by the warm-up's length: exactly 0 (pct_start 0.1 of 10 steps) raises ZeroDivisionError, so such
    a stage gets one warm-up step (step 0 at lr / div_factor), as a slightly larger pct_start does. Other values are
    kept (below one step OneCycleLR starts at the peak; the pinned golden runs do)."""
    return 1.5 / total_steps if math.isclose(pct_start * total_steps, 1.0) else pct_start


def micro_batch_sizes(samples: int, batch_size: int) -> list[int]:
    """Sizes of the epoch's micro-batches on one rank: full batches, then a possibly smaller last one."""
    full, rest = divmod(samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def optimizer_steps_per_epoch(samples_per_rank: int, batch_size: int, accumulation_steps: int) -> int:
    """Optimizer steps in one epoch (the last step may accumulate fewer micro-batches)."""
    return math.ceil(batches_per_epoch(samples_per_rank, batch_size) / accumulation_steps)


def step_batch_sizes(batch_sizes: list[int], step_in_epoch: int, accumulation_steps: int) -> list[int]:
    """Sizes of the micro-batches (of the epoch's `batch_sizes` on this rank) that make up optimizer step
    `step_in_epoch` (0-based), e.g. [4, 4] or, at the end of an epoch, [4, 2] or [2]; empty past the epoch's end."""
    return batch_sizes[step_in_epoch * accumulation_steps : (step_in_epoch + 1) * accumulation_steps]


TOKENIZER_CLIP = 2.0  # reference finetuning's gradient-norm clip for the tokenizer
PREDICTOR_CLIP = 3.0  # ... and for the predictor


def tokenizer_loss(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Tokenizer objective on x (B, T, F): ((mse(z_pre, x) + mse(z, x)) + bsq_loss) / 2.

    `model` is the tokenizer or its DDP wrapper (the forward must go through the wrapper for gradient sync).
    Returns (loss, parts) with parts {"recon_pre", "recon", "bsq"} (detached scalars)."""
    (z_pre, z), bsq_loss, _, _ = model(x)  # z_pre, z (B, T, F): decodes of the s1 bits and of the full code
    recon_pre = F.mse_loss(z_pre.float(), x)
    recon = F.mse_loss(z.float(), x)
    loss = (recon_pre + recon + bsq_loss.float()) / 2
    return loss, {"recon_pre": recon_pre.detach(), "recon": recon.detach(), "bsq": bsq_loss.detach().float()}


def predictor_loss(model: nn.Module, tokenizer: nn.Module, x: torch.Tensor, x_stamp: torch.Tensor, *,
                   teacher_forcing: bool = True, causal_dep: bool | None = None, head: nn.Module | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token objective of the predictor: mean of the s1 and s2 cross-entropies over all positions.

    x (B, T, F) is encoded by the frozen `tokenizer` (no grad, float32 even under autocast, so the tokens are the
    ones inference would produce); the predictor reads tokens[:, :-1] with stamps[:, :-1] and is scored on
    tokens[:, 1:]. `model` is Kronos or its DDP wrapper; `head` defaults to the unwrapped model's head.
    `causal_dep=True` keeps the dependency layer causal in eval mode (needed for an honest validation loss).
    Returns (loss, {"s1_loss", "s2_loss"})."""
    with torch.no_grad(), torch.autocast(device_type=x.device.type, enabled=False):
        s1, s2 = tokenizer.encode(x, half=True)  # (B, T) int64 each
    s1_in, s2_in, stamp_in = s1[:, :-1], s2[:, :-1], x_stamp[:, :-1]  # (B, T-1)
    s1_target, s2_target = s1[:, 1:], s2[:, 1:]  # (B, T-1)
    s1_logits, s2_logits = model(s1_in, s2_in, stamp_in, use_teacher_forcing=teacher_forcing, s1_targets=s1_target,
                                 causal_dep=causal_dep)  # (B, T-1, 2^s1_bits), (B, T-1, 2^s2_bits)
    if head is None:
        head = getattr(model, "module", model).head
    loss, s1_loss, s2_loss = head.compute_loss(s1_logits.float(), s2_logits.float(), s1_target, s2_target)
    return loss, {"s1_loss": s1_loss.detach(), "s2_loss": s2_loss.detach()}


class Stage:
    """One training stage: the model it trains and what is specific to it."""

    name: str  # 'tokenizer' or 'predictor' (messages, checkpoint's "stage" key).
    default_clip: float  # Gradient-norm clip used when training.clip_grad_norm is null.
    # Names of the detached loss parts `loss()` returns beside the loss, in this order (logged as-is, and as
    # val_<name> after validation).
    part_names: tuple[str, ...]
    model: nn.Module  # The module whose parameters are trained (unwrapped).
    # What trains of `model` (training.finetune_mode): the checkpoint's model state, best_model/, counts.
    adapter: adapters.Adapter

    def loss(self, wrapped: nn.Module, x: torch.Tensor, stamp: torch.Tensor, training: bool
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss on one batch: x (B, T, F) float32, stamp (B, T, 5) int64 -> (scalar loss, {part: scalar}).

        `wrapped` is `model` or its DDP wrapper (the forward must go through the wrapper for gradient sync);
        `training=False` gives the validation loss."""
        raise NotImplementedError

    def save_best(self, folder: Path) -> None:
        """Write the model in the published format (save_pretrained) to `folder`, atomically."""
        raise NotImplementedError

    def frozen_fingerprint(self) -> str | None:
        """sha256 of the frozen model this stage's loss depends on (stored in checkpoints; a resume with other
        frozen weights is refused); None when there is none."""
        return None

    def flops_per_token(self, seq: int) -> float:
        """Estimated FLOPs of one training step per token (candle) of windows of `seq` (`forward_flops_per_token`)."""
        raise NotImplementedError


class TokenizerStage(Stage):
    """The BSQ tokenizer trained on reconstruction + BSQ loss."""

    name = "tokenizer"
    default_clip = TOKENIZER_CLIP
    part_names = ("recon_pre", "recon", "bsq")

    def __init__(self, tokenizer: nn.Module, adapter: adapters.Adapter | None = None):
        self.model = tokenizer
        self.adapter = adapter or adapters.Adapter(tokenizer)

    def loss(self, wrapped, x, stamp, training):
        return tokenizer_loss(wrapped, x)

    def save_best(self, folder):
        self.adapter.save_best(folder, {})

    def flops_per_token(self, seq):
        tok = self.model  # the decoder runs twice (from the s1 bits alone and from the full code)
        flops = forward_flops_per_token
        return 3 * (flops([tok], seq) + flops([tok.decoder, tok.head], seq))


class PredictorStage(Stage):
    """The Kronos predictor trained on the next tokens of a frozen tokenizer."""

    name = "predictor"
    default_clip = PREDICTOR_CLIP
    part_names = ("s1_loss", "s2_loss")

    def __init__(self, predictor: nn.Module, tokenizer: nn.Module, teacher_forcing: bool,
                 forecast_info: dict[str, Any] | None = None, adapter: adapters.Adapter | None = None):
        self.model = predictor
        self.adapter = adapter or adapters.Adapter(predictor)
        self.tokenizer = tokenizer
        self.teacher_forcing = teacher_forcing
        self.forecast_info = forecast_info  # max_context / lookback / clip / tokenizer_sha256 (predictor_info)

    def loss(self, wrapped, x, stamp, training):
        # Validation is always teacher-forced and causal: the s2 head at position t must not see later positions.
        return predictor_loss(wrapped, self.tokenizer, x, stamp,
                              teacher_forcing=self.teacher_forcing if training else True,
                              causal_dep=None if training else True, head=self.model.head)

    def save_best(self, folder):
        # The tokenizer's config travels with the predictor so the pair cannot drift apart.
        extra = {TOKENIZER_CONFIG_NAME: dict(getattr(self.tokenizer, "config", {}) or {})}
        models = {}
        if self.forecast_info is not None:  # so that KronosPredictor.from_pretrained(best_model/) needs nothing else
            # Self-contained: the frozen tokenizer is copied inside (tokenizer/), so the folder still loads after a
            # move, a copy to another machine, or a later change of the tokenizer stage.
            extra[PREDICTOR_INFO_NAME] = {**predictor_info(folder, **self.forecast_info), "tokenizer": TOKENIZER_SUBDIR}
            models[TOKENIZER_SUBDIR] = self.tokenizer
        self.adapter.save_best(folder, extra, models)  # lora: merged, plus the adapter alone under adapter/

    def flops_per_token(self, seq):
        # The predictor trains on seq - 1 positions of each window; the frozen tokenizer encodes all seq (forward).
        tok = self.tokenizer
        return (3 * forward_flops_per_token([self.model], seq - 1) * (seq - 1) / seq
                + forward_flops_per_token([tok.embed, tok.encoder, tok.quant_embed], seq))

    def frozen_fingerprint(self):
        base = self.adapter.base_fingerprint  # lora / freeze: the predictor's frozen weights count too
        return weights_fingerprint(self.tokenizer) + (f"+{base}" if base else "")


def restore_optimizer(optimizer: torch.optim.Optimizer, scheduler: Any, saved: dict) -> None:
    """Load the checkpoint's optimizer moments and step count, keeping THIS run's optimisation settings.

    `optimizer.load_state_dict` would bring back the old lr/betas/weight_decay and OneCycle bounds; instead the
    freshly built groups' settings are kept and the freshly built schedule (this run's lr, pct_start, div factors)
    is moved to the checkpoint's step. With unchanged settings this gives the exact same lr as loading the
    scheduler's state (the same closed-form OneCycle formula at the same step)."""
    keep = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved["optimizer"])
    for group, settings in zip(optimizer.param_groups, keep):
        group.update(settings)
    step = int(saved["scheduler"]["last_epoch"])
    scheduler.last_epoch = step
    scheduler._step_count = int(saved["scheduler"].get("_step_count", step + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # get_lr outside step() warns; it is the closed form here
        lrs = scheduler.get_lr() if step > 0 else [g["initial_lr"] for g in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


log = logging.getLogger(__name__)


class Trainer:
    """One training run of one stage. Build it, call `fit()` once.

    stage: what is trained and how its loss is computed (`TokenizerStage` / `PredictorStage`).
    train_set, val_set: datasets of (x (T, F) float32, x_stamp (T, 5) int64) items.
    cfg: loop settings (validated here: a ConfigError lists every problem); out: the stage's folder (rank 0 writes).
    run_config, data_info: stored in run_info.json and the checkpoint; data_info's fingerprint guards a resume.
    val_metric: optional forecast metric (model) -> {"score", ...}, run after each validation; with
        training.select_by = its name, its "score" (lower is better) picks best_model/ instead of val_loss.
    data_extremes: what the data check flagged (for the divergence diagnosis), or None.
    output_key: the pipeline's setting that names `out` (e.g. `paths.base_dir`), quoted when the disk is full.
    window: the `Window` the training windows were cut with (a resume or a finished run on another is refused);
    start: `weights_fingerprint` of the model before training (train_tokenizer / train_predictor take it)."""

    def __init__(self, stage: Stage, train_set: Dataset, val_set: Dataset, cfg: TrainingConfig, out: Path,
                 dist: DistInfo, run_config: dict[str, Any] | None = None, data_info: dict[str, Any] | None = None,
                 val_metric: validate.ValMetric | None = None, data_extremes: str | None = None,
                 output_key: str = "training.output_dir", rebuild_changed: bool = False, window: Window | None = None,
                 start: str | None = None):
        problems = Problems()
        validate_training_config(cfg, problems)
        problems.check(cfg.select_by == "loss" or val_metric is not None, "training.select_by",
                       f"{cfg.select_by!r} needs a forecast metric this pipeline does not provide; use 'loss'")
        problems.raise_if_any()
        # The one place the global random streams are set (see distributed.py): dropout and sampled tokens of this run
        # depend on (seed, rank) only.
        seed_everything(cfg.seed, dist.rank)

        self.stage, self.cfg, self.out, self.dist = stage, cfg, Path(out), dist
        self.model, self.device = stage.model, dist.device
        self.train_set = train_set
        self.run_config = run_config if run_config is not None else {"training": config_to_dict(cfg)}
        self.data_info = data_info
        # What the ledger compares with a checkpoint: given, never read off the dataset (a wrapper would hide it).
        self.inputs = ledger.StageInputs(stage.name, self.out, cfg, self.run_config, self.model_args(),
                                         dist.world_size, window, data_info, stage.frozen_fingerprint(), start)
        self.best_dir = self.out / "best_model"
        self.ckpt_path = self.out / "checkpoints" / checkpoint_store.LAST_NAME  # the newest resumable checkpoint
        self.output_key = output_key  # the pipeline's setting naming `out`, quoted when the disk is full
        self.rebuild_changed = rebuild_changed  # a finished run whose inputs changed is retrained, not refused

        # Data: the samplers fix the order from (seed, epoch); the loaders are rebuilt every epoch. Training windows
        # are shuffled, capped at max_train_samples, an equal share per rank (the remainder dropped).
        self.train_sampler = EpochSampler(len(train_set), shuffle=True, seed=cfg.seed,
                                          max_samples=cfg.max_train_samples, rank=dist.rank,
                                          world_size=dist.world_size, drop_remainder=True)
        samples_per_rank = self.train_sampler.samples_per_rank()
        if samples_per_rank < 1:
            raise DataError(f"{stage.name}: {len(train_set)} training windows cannot be split over "
                            f"{dist.world_size} processes; add data or use fewer processes")
        self.batch_sizes = micro_batch_sizes(samples_per_rank, cfg.batch_size)  # this rank's micro-batches per epoch
        self.steps_per_epoch = optimizer_steps_per_epoch(samples_per_rank, cfg.batch_size, cfg.accumulation_steps)

        # Model, optimizer, schedule (OneCycle over every optimizer step of every epoch).
        self.model.to(self.device)
        self.clip = stage.default_clip if cfg.clip_grad_norm is None else cfg.clip_grad_norm
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay, fused=self.device.type == "cuda")
        self.optimizer.zero_grad(set_to_none=True)  # a model reused after a failed run may hold (NaN) gradients
        # cycle_momentum=False: OneCycleLR would otherwise overwrite AdamW's beta1 (0.85..0.95), ignoring cfg.betas.
        total = self.steps_per_epoch * cfg.epochs
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, max_lr=cfg.lr, total_steps=total, pct_start=one_cycle_pct_start(cfg.pct_start, total),
            div_factor=cfg.div_factor, final_div_factor=cfg.final_div_factor, cycle_momentum=False)
        self.precision = resolve_precision(cfg.amp, self.device)  # said in the log (bf16 on CPU: float32)
        self.validator = validate.Validator(stage, val_set, cfg, dist, self.precision, val_metric)
        # training.compile: the loss of full micro-batches is compiled at the first one (see forward_backward_step).
        self.compile = (self.device.type == "cuda" and not cfg.deterministic if cfg.compile == "auto"
                        else bool(cfg.compile))
        self.compiled_loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None

        # Run safety: one run per folder (rank 0 holds the lock), signals -> graceful stop, non-finite guard.
        self.lock = RunLock(self.out, enabled=dist.is_main, key="the stage's output folder (output_dir)",
                            log=log.warning)
        self.stopper = GracefulStop(enabled=False)  # the real one is entered in fit()
        # A divergence names the keys that set this stage's lr / clip (a stage section shadows `training:`).
        self.guard = NonFiniteGuard(amp=self.precision.autocast_dtype is not None, dist=dist,
                                    data_extremes=data_extremes,
                                    keys={"lr_key": stage_key(self.run_config, stage.name, "lr"),
                                          "clip_key": stage_key(self.run_config, stage.name, "clip_grad_norm")})
        self.stop_agreed = False  # some rank received SIGTERM/SIGINT: stop after this step
        self.step_loss = torch.zeros((), device=self.device)  # the current optimizer step's loss (weighted mean)
        self.plan = ledger.RunPlan("fresh")

        # Run state: replaced by the checkpoint's in resume(); updated by the steps.
        self.state = LoopState()
        self.resume_path: Path | None = None
        self.wrapped: nn.Module = self.model  # the DDP wrapper once resume() ran (the model itself in one process)
        self.logger = MetricsLogger(self.out, enabled=False)  # the real one is opened in open_outputs()
        self.run_extra: dict[str, Any] = {}  # stage, world size, resumed_from: added to every run_info.json
        self.bar = tqdm(disable=True)  # this epoch's progress bar (rank 0 with training.progress_bar)
        self.epoch_start = time.perf_counter()
        self.epoch_sums = validate.LossSums(stage.part_names, self.device)  # the epoch's training loss so far
        self.window = validate.LossSums(stage.part_names, self.device)  # training loss since the last log record
        self.window_start = time.perf_counter()
        self.window_data_wait = 0.0  # seconds this rank waited for the loader in the window
        self.window_len = 0  # T of the last batch: tokens/s = windows/s * T
        self.epoch_tokens, self.epoch_train_s = 0, 0.0  # all ranks' candles trained this epoch, and the seconds
        self.grad_norm: torch.Tensor | None = None  # of the last optimizer step (None without clipping)

    def fit(self) -> TrainResult:
        """Take the folder, decide (resume / skip / overwrite), train the remaining epochs, write the final outputs.

        Raises TrainingStopped after saving on SIGTERM/SIGINT, DivergenceError on a non-finite step (nothing of it
        applied, the last checkpoint kept), RunLockedError / StageFolderError / ConfigError on every rank when the
        folder or settings refuse the run."""
        with GracefulStop() as self.stopper, self.precision.kernels(self.cfg.deterministic) as self.determinism:
            try:
                self.plan = ledger.open_stage(self.inputs, self.lock, self.dist, self.rebuild_changed)
                if self.plan.action == "skip":  # a finished run, current for these inputs: read back, not retrained
                    check_seal(self.out / "best_model", "set training.overwrite=true to train it again")
                    self.resume_path = self.plan.path
                    self.load_state_dict(self.plan.saved)
                    plot = self.out / "loss_curve.png"
                    return self.result(plot if plot.exists() else None, skipped=True)
                # Everything this run logs (rank 0) also goes to <stage>/train.log, appended across resumes.
                with stage_log(self.out / "train.log", rank=self.dist.rank, stage=self.stage.name,
                               resumed_from=self.plan.checkpoint or self.plan.checkpoint_dir):
                    self.resume()
                    self.open_outputs()
                    if self.resume_path is None:
                        self.validate_start()
                    while not self.state.finished:
                        self.train_epoch()
                        self.end_epoch()
                    return self.finish()  # closes the trackers after handing them the final files
            except BaseException as e:
                self.logger.close(failed=True)  # an MLflow run is marked FAILED, metrics.jsonl is flushed
                if isinstance(e, CheckpointWriteError):  # name the pipeline's output setting
                    raise checkpoint_store.space_error(e.filename, e.needed, e.__cause__, self.output_key) from None
                raise
            finally:
                self.logger.close()
                self.lock.release()

    def resume(self) -> None:
        """Load the checkpoint the ledger chose to resume, then wrap the model for DDP (broadcasts rank 0's
        weights)."""
        plan = self.plan
        if plan.saved is not None:
            self.resume_path = plan.path
            self.load_state_dict(plan.saved)
            self.run_extra = {"changed_on_resume": list(plan.changed), "accepted_changed_data": list(plan.accepted)}
            if self.dist.is_main:
                log.info("[%s] resuming from %s at step %d", self.stage.name, self.resume_path, self.state.global_step)
                if plan.changed:
                    log.info("[%s] settings changed since the checkpoint: %s", self.stage.name, "; ".join(plan.changed))
                for text in plan.accepted:
                    log.warning("[%s] training.accept_changed_data=true: %s", self.stage.name, text)
        self.wrapped = wrap_model(self.model, self.dist)

    def open_outputs(self) -> None:
        """metrics.jsonl and run_info.json (rank 0 only)."""
        cfg = self.cfg
        self.logger = MetricsLogger(
            self.out, enabled=self.dist.is_main, tensorboard=cfg.tensorboard, mlflow=cfg.mlflow,
            mlflow_tracking_uri=cfg.mlflow_tracking_uri, mlflow_experiment=cfg.mlflow_experiment, comet=cfg.comet,
            comet_project=cfg.comet_project, run_name=f"{self.out.name}-{self.stage.name}",
            resume_step=self.state.global_step if self.resume_path is not None else None)
        self.run_extra = {"stage": self.stage.name, "world_size": self.dist.world_size, "select_by": cfg.select_by,
                          "frozen_fingerprint": self.inputs.frozen,  # the predictor's tokenizer (sha256 of weights)
                          "start_fingerprint": self.inputs.start,  # what a forecast's zero-shot model must be
                          **self.stage.adapter.counts(),
                          "resumed_from": str(self.resume_path) if self.resume_path else None,
                          **{k: v for k, v in self.run_extra.items() if v}}
        if self.dist.is_main:
            write_run_info(self.out, self.run_config, self.data_info, self.run_extra)
            self.logger.log_params(self.run_config)
            n, total = self.run_extra["trainable_parameters"], self.run_extra["total_parameters"]
            log.info("[%s] finetune_mode=%s: %d of %d parameters train (%.2f%%)", self.stage.name,
                     cfg.finetune_mode, n, total, 100 * n / max(total, 1))
            log.info("[%s] precision: %s; training.compile=%s: %s; training.deterministic: %s", self.stage.name,
                     self.precision.text, cfg.compile, "compiled" if self.compile else "eager", self.determinism)

    def validate_start(self) -> None:
        """Epoch 0: validate the starting model before the first step; it is best_model/ until an epoch beats it.
        The random streams are restored afterwards, so training is the same as without this validation."""
        self.epoch_start = time.perf_counter()
        with validate.rng_fork():
            self.validate_and_select(epoch=0, train_loss=None)

    def train_epoch(self) -> None:
        """The epoch's optimizer steps (or the rest of them, after a mid-epoch resume)."""
        cfg, state = self.cfg, self.state
        self.epoch_start = time.perf_counter()
        self.model.train()
        loader = make_loader(self.train_set, self.train_sampler, cfg.batch_size, epoch=state.epoch, seed=cfg.seed,
                             skip_batches=state.step_in_epoch * cfg.accumulation_steps, num_workers=cfg.num_workers,
                             pin_memory=self.device.type == "cuda")
        # After a resume rank 0 carries the (all ranks') sum of the part of the epoch done before the interruption.
        carried = (state.epoch_loss_sum, state.epoch_windows) if self.dist.is_main else (0.0, 0)
        self.epoch_sums = validate.LossSums(self.stage.part_names, self.device, *carried)
        self.epoch_tokens, self.epoch_train_s = 0, 0.0
        self.reset_window()
        show_bar = self.dist.is_main and cfg.progress_bar
        self.bar = tqdm(total=self.steps_per_epoch, initial=state.step_in_epoch, disable=not show_bar,
                        desc=f"{self.stage.name} epoch {state.epoch + 1}/{cfg.epochs}", dynamic_ncols=True, leave=False)
        with logging_redirect_tqdm() if show_bar else contextlib.nullcontext():  # log lines above the bar
            batches = iter(loader)
            while state.step_in_epoch < self.steps_per_epoch:
                self.train_step(batches)
                self.after_step()
            del batches  # shuts the loader's workers down
        self.bar.close()

    def train_step(self, batches) -> None:
        """One optimizer step: its micro-batches from `batches` (forward + backward each), then the update."""
        sizes = step_batch_sizes(self.batch_sizes, self.state.step_in_epoch, self.cfg.accumulation_steps)
        self.step_loss = torch.zeros((), device=self.device)
        for i in range(len(sizes)):
            t_wait = time.perf_counter()
            x, stamp = next(batches)
            self.window_data_wait += time.perf_counter() - t_wait
            x = x.to(self.device, non_blocking=True)  # (B, T, F)
            stamp = stamp.to(self.device, non_blocking=True)  # (B, T, 5)
            # Weight each micro-batch by its share of the step's windows, so the step's gradient is the mean over
            # all its windows also when the epoch's last micro-batch is smaller.
            self.forward_backward_step(x, stamp, weight=x.shape[0] / sum(sizes), sync=i == len(sizes) - 1)
        self.optimizer_step()

    def forward_backward_step(self, x: torch.Tensor, stamp: torch.Tensor, weight: float, sync: bool) -> None:
        """Loss of one micro-batch x (B, T, F), stamp (B, T, 5); backward of loss * weight; DDP all-reduces the
        gradients only when `sync` (the step's last micro-batch). The loss goes into the window and epoch sums.
        training.compile: full micro-batches run the compiled loss (forward + backward; static shapes, compiled at
        the first), the epoch's ragged last one eagerly: windows, step counts and resume are those of an eager run.
        A failing compile logs one warning and that step runs eagerly, its random streams put back."""
        compiled = self.compile and x.shape[0] == self.cfg.batch_size
        if compiled and self.compiled_loss is None:  # the run's first full micro-batch: a step's first, no gradient
            saved = checkpoint_store.rng_state()
            try:
                torch.compiler.reset()  # a fresh cache per stage (many stages in one process: no recompile limit)
                self.compiled_loss = torch.compile(self.stage.loss, dynamic=False)
                return self.forward_backward_step(x, stamp, weight, sync)
            except Exception as e:  # noqa: BLE001 - any compiler failure: the eager step still trains
                log.warning("[%s] training.compile: compiling the training step failed (%s: %s); training eagerly",
                            self.stage.name, type(e).__name__, (str(e).strip().splitlines() or [""])[0][:300])
                self.compile, self.compiled_loss, compiled = False, None, False
                self.optimizer.zero_grad(set_to_none=True)
                checkpoint_store.set_rng_state(saved)
        loss_fn = self.compiled_loss if compiled else self.stage.loss
        with contextlib.nullcontext() if sync else no_sync(self.wrapped):
            with self.precision.autocast():
                loss, parts = loss_fn(self.wrapped, x, stamp, training=True)
            (loss * weight).backward()
        self.step_loss = self.step_loss + loss.detach().float() * weight  # the step's window-weighted mean loss
        self.window.add(loss, parts, x.shape[0])
        self.epoch_sums.add(loss, parts, x.shape[0])
        self.window_len = x.shape[1]

    def optimizer_step(self) -> None:
        """Clip, check (all ranks agree: a non-finite loss/gradient raises DivergenceError before any weight moves;
        a stop request is agreed in the same all-reduce), update, advance the schedule and the step counters."""
        if self.clip > 0:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        else:  # no clipping, but the guard still needs the norm
            self.grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        if self.device.type == "cuda" and self.dist.world_size == 1:  # no host sync: see check_later
            self.optimizer.found_inf = self.guard.check_later(self.state.global_step + 1, self.step_loss,
                                                              self.grad_norm)  # the fused AdamW skips a bad step
            self.stop_agreed = self.stopper.requested
        else:
            self.stop_agreed = self.guard.check(self.state.global_step + 1, self.step_loss, self.grad_norm,
                                                stop=self.stopper.requested)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        self.state.step_in_epoch += 1
        self.bar.update(1)

    def after_step(self) -> None:
        """Log the window, write a mid-epoch checkpoint when due, then the test fault hook."""
        state, cfg = self.state, self.cfg
        end_of_epoch = state.step_in_epoch == self.steps_per_epoch
        if should_log(state.global_step, cfg.log_every_steps, end_of_epoch):
            self.log_window()
        if self.stop_agreed:
            self.save_last(mid_epoch=True)
            raise TrainingStopped(self.stopper.signal_name or "a signal to another process", self.ckpt_path,
                                  state.global_step)
        if not end_of_epoch and should_save_checkpoint(state.global_step, cfg.save_every_steps):
            self.save_last(mid_epoch=True)
        maybe_die_after_step(state.global_step, self.dist.rank)

    def reset_window(self) -> None:
        """Start a new log window (sums, clock, loader wait)."""
        self.window = validate.LossSums(self.stage.part_names, self.device)
        self.window_start = time.perf_counter()
        self.window_data_wait = 0.0

    def log_window(self) -> None:
        """One metrics.jsonl "train" record: the window's mean losses over all ranks, throughput, loader wait."""
        self.guard.settle()  # a non-finite step raises before it is logged or saved
        seconds = max(time.perf_counter() - self.window_start, 1e-9)
        totals = self.window.reduce(extra=[self.window_data_wait])
        record = totals.means()
        record["samples_per_s"] = totals.windows / seconds
        record["tokens_per_s"] = totals.windows * self.window_len / seconds  # candles (= token pairs) per second
        record["data_wait_s"] = totals.extra[0] / self.dist.world_size  # mean over ranks
        record["seconds"] = seconds
        if self.precision.peak_flops is not None:
            record["mfu"] = self.mfu(record["tokens_per_s"])
        self.epoch_tokens += totals.windows * self.window_len
        self.epoch_train_s += seconds
        record.update(step=self.state.global_step, epoch=self.state.epoch + 1, lr=self.scheduler.get_last_lr()[0])
        if self.grad_norm is not None:
            record["grad_norm"] = float(self.grad_norm)
        if not math.isfinite(record["loss"]):
            raise DivergenceError(f"{self.stage.name}: training loss is {record['loss']} at step "
                                                   f"{self.state.global_step}; lower training.lr or set "
                                                   "training.amp=none")
        self.logger.log({"kind": "train", **record})
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        self.reset_window()

    def end_epoch(self) -> None:
        """Validate, keep the best model, update early stopping, write the checkpoint."""
        state, cfg = self.state, self.cfg
        train_loss = self.epoch_sums.reduce().mean("loss")
        stop = self.validate_and_select(epoch=state.epoch + 1, train_loss=train_loss)
        state.epoch, state.step_in_epoch = state.epoch + 1, 0
        state.epoch_loss_sum, state.epoch_windows = 0.0, 0
        state.stopped_early = stop and state.epoch < cfg.epochs
        state.finished = stop or state.epoch >= cfg.epochs
        self.save_last()

    def validate_and_select(self, epoch: int, train_loss: float | None) -> bool:
        """Validate after `epoch` (0 = the starting model), save best_model/ when the score improved, log the
        record; returns the early-stopping decision."""
        state, cfg, dist = self.state, self.cfg, self.dist
        sel = self.validator.validate_and_select(self.wrapped, epoch, state.best_score, state.bad_epochs)
        if sel.improved:
            state.best_epoch, state.best_val_loss = epoch, sel.values["val_loss"]
            if dist.is_main:
                self.save_best(epoch, state.best_val_loss)
            barrier()
        state.best_score, state.bad_epochs = sel.best, sel.bad_epochs
        entry = {"epoch": epoch, "step": state.global_step, "train_loss": train_loss, **sel.values,
                 "lr": self.scheduler.get_last_lr()[0], "seconds": time.perf_counter() - self.epoch_start}
        state.history.append(entry)
        self.logger.log({"kind": "val", **entry, "best_val_loss": state.best_val_loss, "best_score": state.best_score,
                         "improved": sel.improved})
        if dist.is_main:
            what = "starting model" if epoch == 0 else f"epoch {epoch}/{cfg.epochs}  train {train_loss:.4f}"
            log.info("[%s] %s  val %.4f%s  best %.4f%s%s", self.stage.name, what, entry["val_loss"],
                     f"  {cfg.select_by} {entry['score']:.4f}" if cfg.select_by != "loss" else "", state.best_score,
                     "  (saved)" if sel.improved else "", self.throughput() if epoch > 0 else "")
        return sel.stop

    def mfu(self, tokens_per_s: float) -> float:
        """Model FLOPs utilisation of all ranks' devices at `tokens_per_s` (candles per second, all ranks)."""
        flops = tokens_per_s * self.stage.flops_per_token(self.window_len)
        return flops / (self.precision.peak_flops * self.dist.world_size)

    def throughput(self) -> str:
        """"  <n> tokens/s  MFU <x>%" of the epoch's training steps (all ranks, validation excluded)."""
        per_s = self.epoch_tokens / max(self.epoch_train_s, 1e-9)
        mfu = f"  MFU {100 * self.mfu(per_s):.1f}%" if self.precision.peak_flops is not None else ""
        return f"  {per_s:,.0f} tokens/s{mfu}"

    def save_best(self, epoch: int, val_loss: float) -> None:
        """best_model/ in the published format plus its run_info.json (rank 0); never non-finite weights, and a
        full disk is reported with the folder, free space and bytes needed."""
        state = self.model.state_dict()
        checkpoint_store.assert_finite_state_dict(state, str(self.best_dir))
        needed = checkpoint_store.estimate_bytes(state)
        with checkpoint_store.full_disk_named(self.best_dir / "model.safetensors", needed):
            self.stage.save_best(self.best_dir)
            write_run_info(self.best_dir, self.run_config, self.data_info,
                           {**self.run_extra, "epoch": epoch, "val_loss": val_loss})
            seal(self.best_dir)  # with its run_info.json (checked where a model is loaded: from_pretrained)

    def save_last(self, mid_epoch: bool = False) -> None:
        """Write checkpoints/last.pt (rank 0; every rank's RNG state included), then wait for all ranks.

        `mid_epoch`: also store the epoch's running training loss (all ranks' sums) so a resumed epoch reports the
        same mean as an uninterrupted one."""
        self.guard.settle()
        if mid_epoch:
            totals = self.epoch_sums.reduce()
            self.state.epoch_loss_sum, self.state.epoch_windows = totals.sums["loss"], totals.windows
        checkpoint_store.save(self, self.ckpt_path.parent, self.state.global_step, keep=self.cfg.keep_checkpoints,
                              log=log.warning, write=self.dist.is_main)
        barrier()

    def state_dict(self) -> checkpoint_store.Checkpoint:
        """Everything a resumed run needs, as the checkpoint holds it; every rank calls it (gathers RNG states)."""
        rngs = all_gather_object(checkpoint_store.rng_state())  # every rank resumes its own random stream
        return {"format": checkpoint_store.CHECKPOINT_FORMAT, **self.inputs.record(),
                "model": self.stage.adapter.checkpoint_state(),  # lora / freeze: what trains only
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "loop": dataclasses.asdict(self.state), "rng": rngs, "threads": torch.get_num_threads()}

    def load_state_dict(self, saved: checkpoint_store.Checkpoint) -> None:
        """Continue from `saved` (checked by `resume` / `read_finished`): weights, optimizer moments and step (with
        this run's optimisation settings), the loop's counters and history, this rank's random streams."""
        self.stage.adapter.load_checkpoint_state(saved["model"], self.resume_path)
        restore_optimizer(self.optimizer, self.scheduler, saved)
        self.state = LoopState(**saved["loop"])
        checkpoint_store.set_rng_state(saved["rng"][self.dist.rank])
        # CPU reductions split their sums by thread: the saved run's count continues its exact arithmetic (the
        # engine picks threads from the machine's load, which may differ now); OMP_NUM_THREADS still wins.
        if saved.get("threads") not in (None, torch.get_num_threads()) and not os.environ.get("OMP_NUM_THREADS"):
            log.info("[%s] %d intra-op threads, as the run being resumed used", self.stage.name, saved["threads"])
            torch.set_num_threads(saved["threads"])

    def model_args(self) -> dict[str, Any]:
        """The model's constructor arguments as plain data (checkpoint's "model_args")."""
        return plain(dict(getattr(self.model, "config", {}) or {}))

    def finish(self) -> TrainResult:
        """Loss plot and final run_info.json with "finished": true (rank 0), then the result."""
        state = self.state
        plot_path = self.out / "loss_curve.png"
        if self.dist.is_main:
            source = (self.run_config.get("model") or {}).get(f"pretrained_{self.stage.name}")
            title = loss_plot_title(self.stage.name, source)  # "finetuned from X" or "trained from scratch"
            if plot_loss_curves(read_metrics(self.logger.path), plot_path, title=title,
                                best_epoch=self.state.best_epoch) is None:
                plot_path = None
            result = {"best_val_loss": state.best_val_loss, "best_epoch": state.best_epoch,
                      "best_score": state.best_score, "global_step": state.global_step,
                      "stopped_early": state.stopped_early, "finished": state.finished}
            write_run_info(self.out, self.run_config, self.data_info, {**self.run_extra, "result": result})
            if state.best_epoch == 0 and state.global_step > 0:
                log.info("[%s] no epoch beat the starting model; best_model/ is the starting model", self.stage.name)
            self.logger.log_artifacts(*(p for p in (plot_path, self.out / "run_info.json") if p is not None))
        self.logger.close()
        barrier()
        return self.result(plot_path if plot_path is not None and plot_path.exists() else None)

    def result(self, plot_path: Path | None, skipped: bool = False) -> TrainResult:
        state = self.state
        return TrainResult(
            stage=self.stage.name, best_val_loss=state.best_val_loss, best_epoch=state.best_epoch,
            output_dir=self.out, best_model_dir=self.best_dir, last_checkpoint=self.ckpt_path,
            metrics_path=self.out / "metrics.jsonl", plot_path=plot_path, run_info_path=self.out / "run_info.json",
            history=list(state.history), global_step=state.global_step, stopped_early=state.stopped_early,
            resumed_from=self.resume_path, best_score=state.best_score, skipped=skipped)


def train_tokenizer(tokenizer: nn.Module, train_set: Dataset, val_set: Dataset, cfg: TrainingConfig,
                    output_dir: str | Path, dist: DistInfo, **options: Any) -> TrainResult:
    """Finetune the BSQ tokenizer (trained in place on `dist.device`) on x (B, T, F) windows; the best epoch is saved
    with save_pretrained. The arguments are `Trainer`'s (`output_dir` its `out`; `options`: run_config, data_info,
    val_metric, data_extremes, output_key); clip_grad_norm defaults to 2.0."""
    options.setdefault("start", weights_fingerprint(tokenizer))  # the starting weights, before anything trains
    stage = TokenizerStage(tokenizer, adapters.prepare(tokenizer, cfg, "tokenizer"))  # lora / freeze: refused
    return Trainer(stage, train_set, val_set, cfg, Path(output_dir), dist, **options).fit()


def train_predictor(predictor: nn.Module, tokenizer: nn.Module, train_set: Dataset, val_set: Dataset,
                    cfg: TrainingConfig, output_dir: str | Path, dist: DistInfo, *,
                    forecast_info: dict[str, Any] | None = None, **options: Any) -> TrainResult:
    """Finetune the Kronos predictor on tokens of the frozen `tokenizer`; the best epoch is saved with
    save_pretrained plus the tokenizer's config (tokenizer_config.json). Arguments as in `train_tokenizer`;
    clip_grad_norm defaults to 3.0; `cfg.teacher_forcing` picks the s2 conditioning used in training.
    `forecast_info` (`model.predictor.predictor_info`'s arguments but the tokenizer) is written beside the best
    model as kronos_predictor.json, so `KronosPredictor.from_pretrained(best_model/)` loads the whole forecaster."""
    tokenizer.to(dist.device).eval().requires_grad_(False)
    options.setdefault("start", weights_fingerprint(predictor))  # before an adapter adds (random) weights
    adapter = adapters.prepare(predictor, cfg, "predictor")  # training.finetune_mode: what trains
    stage = PredictorStage(predictor, tokenizer, cfg.teacher_forcing, forecast_info, adapter)
    try:
        return Trainer(stage, train_set, val_set, cfg, Path(output_dir), dist, **options).fit()
    finally:
        adapter.unload()  # the caller's predictor is a plain Kronos again (lora merged in place)


@torch.no_grad()
def evaluate_predictor(predictor: nn.Module, tokenizer: nn.Module, dataset: Dataset, cfg: TrainingConfig,
                       dist: DistInfo) -> dict[str, float]:
    """Causal, teacher-forced predictor loss averaged over validation windows (all ranks)."""
    tokenizer.to(dist.device).eval()
    stage = PredictorStage(predictor.to(dist.device), tokenizer, True)
    return validate.evaluate(stage, predictor, dataset, validate.val_sampler(dataset, cfg, dist), cfg, dist, 0,
                             resolve_precision(cfg.amp, dist.device))
