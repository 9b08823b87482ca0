"""The training loops both pipelines call: `train_tokenizer` and `train_predictor`, one generic loop underneath.

    with distributed_context(cfg.training.dist_timeout_s) as dist:
        seed_everything(cfg.training.seed, dist.rank)                    # before building models (dropout, init)
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from .checkpoint import (
    CHECKPOINT_FORMAT,
    atomic_torch_save,
    find_resume_checkpoint,
    last_checkpoint_path,
    load_checkpoint,
    rng_state,
    save_pretrained_atomic,
    set_rng_state,
)
from .config_utils import Problems, config_to_dict
from .distributed import DistInfo, all_reduce_sum, barrier, seed_everything
from .metrics import MetricsLogger, plot_loss_curves, read_metrics
from .provenance import write_run_info
from .window_dataset import EpochSampler, batches_per_epoch, make_loader

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
]

# Test hook (fault injection): after optimizer step N (and its checkpoint, if one is due), the process calls
# os._exit. KRONOS_FAULT_RANK limits it to one rank, KRONOS_FAULT_EXIT_CODE sets the exit code (default 17).
FAULT_ENV = "KRONOS_FAULT_EXIT_AFTER_STEP"

TOKENIZER_CLIP = 2.0  # reference finetuning's gradient-norm clip for the tokenizer
PREDICTOR_CLIP = 3.0  # ... and for the predictor


@dataclass
class TrainingConfig:
    """Settings of the shared training loop (a `training:`-style YAML section in both pipelines)."""

    epochs: int = 30
    """Passes over the (possibly capped) training windows."""
    batch_size: int = 50
    """Windows per forward pass on EACH process; global batch = batch_size * world_size * accumulation_steps."""
    accumulation_steps: int = 1
    """Micro-batches whose gradients are summed before one optimizer step."""
    lr: float = 2e-4
    """Peak learning rate of the OneCycle schedule (reference: 2e-4 tokenizer, 4e-5 predictor)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (kept fixed: the schedule does not cycle momentum)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    pct_start: float = 0.03
    """Fraction of all optimizer steps spent warming the learning rate up to `lr`."""
    div_factor: float = 10.0
    """OneCycle: the first learning rate is lr / div_factor."""
    final_div_factor: float = 1e4
    """OneCycle: the last learning rate is lr / div_factor / final_div_factor."""
    clip_grad_norm: float | None = None
    """Max gradient norm; null = stage default (2.0 tokenizer, 3.0 predictor); 0 = no clipping."""
    amp: Literal["none", "bf16"] = "none"
    """Mixed precision: 'bf16' runs the forward under bfloat16 autocast on CUDA (ignored with a warning on CPU)."""
    seed: int = 100
    """Base seed; each process uses seed + rank; data order depends on (seed, epoch) only."""
    num_workers: int = 2
    """DataLoader worker processes per rank (0 = load in the training process)."""
    max_train_samples: int | None = None
    """Windows drawn per training epoch (a fresh seeded subset each epoch; Qlib's n_train_iter); null = all."""
    max_val_samples: int | None = None
    """Windows drawn per validation (a fresh seeded subset each epoch; Qlib's n_val_iter); null = all."""
    log_every_steps: int = 10
    """Write a metrics.jsonl record every this many optimizer steps (and at each epoch's last step)."""
    save_every_steps: int = 0
    """Also write checkpoints/last.pt every this many optimizer steps (0 = only at the end of each epoch)."""
    patience: int = 0
    """Stop after this many epochs without a better validation loss (0 = never stop early)."""
    min_delta: float = 0.0
    """A validation loss counts as better only if it beats the best by more than this."""
    resume: str = "auto"
    """'auto' = continue from <output_dir>/checkpoints/last.pt if present; 'never'; or a path to a last.pt."""
    teacher_forcing: bool = True
    """Predictor: condition s2 on the true next s1 (false = on a sampled s1); validation always uses the true s1."""
    dist_timeout_s: float = 1800.0
    """Seconds a collective waits for the other ranks before the job fails instead of hanging."""
    progress_bar: bool = True
    """Show a tqdm progress bar (rank 0 only)."""
    tensorboard: bool = False
    """Also log to TensorBoard under <output_dir>/tensorboard (if tensorboard is installed)."""
    comet: bool = False
    """Also log to Comet (if comet_ml is installed and configured)."""
    comet_project: str = "kronos-finetune"
    """Comet project name."""


# Settings that fix the data order and the learning-rate schedule: a checkpoint can only be resumed with the same.
_RESUME_KEYS = ("epochs", "batch_size", "accumulation_steps", "lr", "pct_start", "div_factor", "final_div_factor",
                "seed", "max_train_samples")


def validate_training_config(cfg: TrainingConfig, problems: Problems, prefix: str = "training") -> None:
    """Add every problem of `cfg` to `problems`, each named by its YAML key (`prefix.field`)."""
    k = (lambda name: f"{prefix}.{name}" if prefix else name)
    problems.check(cfg.epochs >= 1, k("epochs"), f"must be >= 1, got {cfg.epochs}")
    problems.check(cfg.batch_size >= 1, k("batch_size"), f"must be >= 1, got {cfg.batch_size}")
    problems.check(cfg.accumulation_steps >= 1, k("accumulation_steps"), f"must be >= 1, got {cfg.accumulation_steps}")
    problems.check(cfg.lr > 0, k("lr"), f"must be > 0, got {cfg.lr}")
    problems.check(
        len(cfg.betas) == 2 and all(0 <= b < 1 for b in cfg.betas), k("betas"),
        f"need two values in [0, 1), got {cfg.betas}",
    )
    problems.check(cfg.weight_decay >= 0, k("weight_decay"), f"must be >= 0, got {cfg.weight_decay}")
    problems.check(0 < cfg.pct_start < 1, k("pct_start"), f"must be in (0, 1), got {cfg.pct_start}")
    problems.check(cfg.div_factor > 0, k("div_factor"), f"must be > 0, got {cfg.div_factor}")
    problems.check(cfg.final_div_factor > 0, k("final_div_factor"), f"must be > 0, got {cfg.final_div_factor}")
    problems.check(
        cfg.clip_grad_norm is None or cfg.clip_grad_norm >= 0, k("clip_grad_norm"),
        f"must be >= 0 or null, got {cfg.clip_grad_norm}",
    )
    problems.check(cfg.amp in ("none", "bf16"), k("amp"), f"must be 'none' or 'bf16', got {cfg.amp!r}")
    problems.check(cfg.num_workers >= 0, k("num_workers"), f"must be >= 0, got {cfg.num_workers}")
    for name in ("max_train_samples", "max_val_samples"):
        v = getattr(cfg, name)
        problems.check(v is None or v >= 1, k(name), f"must be >= 1 or null (all windows), got {v}")
    problems.check(cfg.log_every_steps >= 1, k("log_every_steps"), f"must be >= 1, got {cfg.log_every_steps}")
    problems.check(cfg.save_every_steps >= 0, k("save_every_steps"), f"must be >= 0, got {cfg.save_every_steps}")
    problems.check(cfg.patience >= 0, k("patience"), f"must be >= 0 (0 = no early stopping), got {cfg.patience}")
    problems.check(cfg.min_delta >= 0, k("min_delta"), f"must be >= 0, got {cfg.min_delta}")
    problems.check(cfg.dist_timeout_s > 0, k("dist_timeout_s"), f"must be > 0, got {cfg.dist_timeout_s}")


# ----------------------------------------------------------------------------------------------------------------
# small pure decisions (unit-tested)


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


# ----------------------------------------------------------------------------------------------------------------
# losses


def tokenizer_loss(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Tokenizer objective on x (B, T, F): ((mse(z_pre, x) + mse(z, x)) + bsq_loss) / 2.

    `model` is the tokenizer or its DDP wrapper (the forward must go through the wrapper for gradient sync).
    Returns (loss, parts) with parts {"recon_pre", "recon", "bsq"} (detached scalars).
    """
    (z_pre, z), bsq_loss, _, _ = model(x)  # z_pre, z (B, T, F): decodes of the s1 bits and of the full code
    recon_pre = F.mse_loss(z_pre.float(), x)
    recon = F.mse_loss(z.float(), x)
    loss = (recon_pre + recon + bsq_loss.float()) / 2
    return loss, {"recon_pre": recon_pre.detach(), "recon": recon.detach(), "bsq": bsq_loss.detach().float()}


def predictor_loss(
    model: nn.Module,
    tokenizer: nn.Module,
    x: torch.Tensor,
    x_stamp: torch.Tensor,
    *,
    teacher_forcing: bool = True,
    causal_dep: bool | None = None,
    head: nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token objective of the predictor: mean of the s1 and s2 cross-entropies over all positions.

    x (B, T, F) is encoded by the frozen `tokenizer` (no grad, float32 even under autocast, so the tokens are the
    ones inference would produce); the predictor reads tokens[:, :-1] with stamps[:, :-1] and is scored on
    tokens[:, 1:]. `model` is Kronos or its DDP wrapper; `head` defaults to the unwrapped model's head.
    `causal_dep=True` keeps the dependency layer causal in eval mode (needed for an honest validation loss).
    Returns (loss, {"s1_loss", "s2_loss"}).
    """
    with torch.no_grad(), torch.autocast(device_type=x.device.type, enabled=False):
        s1, s2 = tokenizer.encode(x, half=True)  # (B, T) int64 each
    s1_in, s2_in, stamp_in = s1[:, :-1], s2[:, :-1], x_stamp[:, :-1]  # (B, T-1)
    s1_target, s2_target = s1[:, 1:], s2[:, 1:]  # (B, T-1)
    kwargs = {"use_teacher_forcing": teacher_forcing, "s1_targets": s1_target}
    if causal_dep is not None:
        kwargs["causal_dep"] = causal_dep
    s1_logits, s2_logits = model(s1_in, s2_in, stamp_in, **kwargs)  # (B, T-1, 2^s1_bits), (B, T-1, 2^s2_bits)
    if head is None:
        head = getattr(model, "module", model).head
    loss, s1_loss, s2_loss = head.compute_loss(s1_logits.float(), s2_logits.float(), s1_target, s2_target)
    return loss, {"s1_loss": s1_loss.detach(), "s2_loss": s2_loss.detach()}


# ----------------------------------------------------------------------------------------------------------------
# result


@dataclass
class TrainResult:
    """What a training loop returns."""

    stage: str
    """'tokenizer' or 'predictor'."""
    best_val_loss: float
    """Lowest validation loss (sample-weighted over all validation windows); inf if none was finite."""
    best_epoch: int | None
    """Epoch (0-based) of the best validation loss."""
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
    """One dict per finished epoch: epoch, step, train_loss, val_loss, lr, seconds."""
    global_step: int = 0
    """Optimizer steps done."""
    stopped_early: bool = False
    """True when patience ran out before the last epoch."""
    resumed_from: Path | None = None
    """Checkpoint this run continued from, if any."""


# ----------------------------------------------------------------------------------------------------------------
# the two stages: what differs between tokenizer and predictor training


class _Stage:
    name: str
    default_clip: float
    model: nn.Module

    def loss(self, wrapped: nn.Module, x: torch.Tensor, stamp: torch.Tensor, training: bool):
        raise NotImplementedError

    def save_best(self, folder: Path) -> None:
        raise NotImplementedError


class _TokenizerStage(_Stage):
    name = "tokenizer"
    default_clip = TOKENIZER_CLIP

    def __init__(self, tokenizer: nn.Module):
        self.model = tokenizer

    def loss(self, wrapped, x, stamp, training):
        return tokenizer_loss(wrapped, x)

    def save_best(self, folder):
        save_pretrained_atomic(self.model, folder)


class _PredictorStage(_Stage):
    name = "predictor"
    default_clip = PREDICTOR_CLIP

    def __init__(self, predictor: nn.Module, tokenizer: nn.Module, teacher_forcing: bool):
        self.model = predictor
        self.tokenizer = tokenizer
        self.teacher_forcing = teacher_forcing

    def loss(self, wrapped, x, stamp, training):
        # Validation is always teacher-forced and causal: the s2 head at position t must not see later positions.
        return predictor_loss(
            wrapped,
            self.tokenizer,
            x,
            stamp,
            teacher_forcing=self.teacher_forcing if training else True,
            causal_dep=None if training else True,
            head=self.model.head,
        )

    def save_best(self, folder):
        # The tokenizer's config travels with the predictor so the pair cannot drift apart.
        extra = {"tokenizer_config.json": dict(getattr(self.tokenizer, "config", {}) or {})}
        save_pretrained_atomic(self.model, folder, extra_json=extra)


# ----------------------------------------------------------------------------------------------------------------
# public loops


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
    return _fit(_TokenizerStage(tokenizer), train_set, val_set, cfg, output_dir, dist, run_config, data_info)


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
    stage = _PredictorStage(predictor, tokenizer, cfg.teacher_forcing)
    return _fit(stage, train_set, val_set, cfg, output_dir, dist, run_config, data_info)


@torch.no_grad()
def evaluate_tokenizer(
    tokenizer: nn.Module, dataset: Dataset, cfg: TrainingConfig, dist: DistInfo, epoch: int = 0
) -> dict[str, float]:
    """Tokenizer loss averaged over validation windows (all ranks), e.g. {"val_loss": .., "val_recon": ..}."""
    stage = _TokenizerStage(tokenizer.to(dist.device))
    return _evaluate(stage, tokenizer, dataset, _val_sampler(dataset, cfg, dist), cfg, dist, epoch)


@torch.no_grad()
def evaluate_predictor(
    predictor: nn.Module, tokenizer: nn.Module, dataset: Dataset, cfg: TrainingConfig, dist: DistInfo, epoch: int = 0
) -> dict[str, float]:
    """Causal, teacher-forced predictor loss averaged over validation windows (all ranks)."""
    tokenizer.to(dist.device).eval()
    stage = _PredictorStage(predictor.to(dist.device), tokenizer, True)
    return _evaluate(stage, predictor, dataset, _val_sampler(dataset, cfg, dist), cfg, dist, epoch)


# ----------------------------------------------------------------------------------------------------------------
# the generic loop


@dataclass
class _LoopState:
    """Everything besides tensors that a resumed run needs to continue exactly."""

    epoch: int = 0
    step_in_epoch: int = 0
    epoch_loss_sum: float = 0.0  # all ranks' sum of per-window training losses so far in this epoch
    epoch_windows: int = 0  # ... and the number of windows
    global_step: int = 0
    best_val_loss: float = math.inf
    best_epoch: int | None = None
    bad_epochs: int = 0
    stopped_early: bool = False
    finished: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)


def _train_sampler(dataset: Dataset, cfg: TrainingConfig, dist: DistInfo) -> EpochSampler:
    return EpochSampler(
        len(dataset), shuffle=True, seed=cfg.seed, max_samples=cfg.max_train_samples,
        rank=dist.rank, world_size=dist.world_size, drop_remainder=True,
    )


def _val_sampler(dataset: Dataset, cfg: TrainingConfig, dist: DistInfo) -> EpochSampler:
    # Validation: ordered, nothing dropped or duplicated (exact loss); a capped run draws a seeded subset per epoch.
    return EpochSampler(
        len(dataset), shuffle=False, seed=cfg.seed + 1, max_samples=cfg.max_val_samples,
        rank=dist.rank, world_size=dist.world_size, drop_remainder=False,
    )


def _autocast(cfg: TrainingConfig, device: torch.device):
    if cfg.amp == "bf16" and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _wrap(model: nn.Module, dist: DistInfo) -> nn.Module:
    """DDP around `model` when there are several processes; the model itself otherwise (same call syntax)."""
    if not dist.distributed:
        return model
    # broadcast_buffers=False: the only buffers are constants (rotary frequencies, BSQ bases), and skipping the
    # per-forward broadcast lets ranks run different numbers of validation batches without a collective mismatch.
    # (newer torch names the flag forward_sync_buffers and deprecates broadcast_buffers)
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
        else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(
        model,
        device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        **no_buffer_sync,
    )


def _no_sync(wrapped: nn.Module):
    return wrapped.no_sync() if isinstance(wrapped, DistributedDataParallel) else contextlib.nullcontext()


def _check_resume_compatible(saved: dict, cfg: TrainingConfig, dist: DistInfo, stage: str, model: nn.Module,
                             path: Path) -> None:
    """One error listing every setting that differs from the checkpoint's (they would change data order/schedule)."""
    problems = Problems(f"Cannot resume from {path}")
    if saved.get("stage") != stage:
        problems.add("training.resume", f"the checkpoint is from the {saved.get('stage')} stage, not {stage}")
    model_args = _plain(dict(getattr(model, "config", {}) or {}))
    for key in sorted(set(model_args) | set(saved.get("model_args", {}))):
        if saved.get("model_args", {}).get(key) != model_args.get(key):
            problems.add(f"model.{key}", f"the checkpoint's model has {saved['model_args'].get(key)!r}, "
                                         f"this one {model_args.get(key)!r}")
    old = saved.get("training_config", {})
    for key in _RESUME_KEYS:
        new_value = config_to_dict(getattr(cfg, key))
        if key in old and old[key] != new_value:
            problems.add(f"training.{key}",
                         f"the checkpoint was made with {old[key]!r}, the config now says {new_value!r}")
    if saved.get("world_size") != dist.world_size:
        problems.add("(torchrun --nproc_per_node)",
                     f"the checkpoint was made with {saved.get('world_size')} processes, now {dist.world_size}")
    if problems:
        problems.add("training.resume", "set it to 'never' or use a new output folder to start over")
    problems.raise_if_any()


def _fit(
    stage: _Stage,
    train_set: Dataset,
    val_set: Dataset,
    cfg: TrainingConfig,
    output_dir: str | Path,
    dist: DistInfo,
    run_config: dict[str, Any] | None,
    data_info: dict[str, Any] | None,
) -> TrainResult:
    """The generic loop behind both stages: build, resume, train epochs (validate, keep best, checkpoint), finish."""
    problems = Problems()
    validate_training_config(cfg, problems)
    problems.raise_if_any()
    run = _Run(stage, train_set, val_set, cfg, Path(output_dir), dist, run_config, data_info)
    try:
        run.resume()
        run.open_outputs()
        while not run.state.finished:
            run.train_epoch()
            run.end_epoch()
    finally:
        run.logger.close()
    return run.finish()


class _Run:
    """State and steps of one training run (see `_fit` for the order in which they are called)."""

    def __init__(self, stage, train_set, val_set, cfg, out, dist, run_config, data_info):
        self.stage, self.cfg, self.out, self.dist = stage, cfg, out, dist
        self.train_set, self.val_set = train_set, val_set
        self.data_info = data_info
        self.run_config = run_config if run_config is not None else {"training": config_to_dict(cfg)}
        self.best_dir, self.ckpt_path = out / "best_model", last_checkpoint_path(out)
        self.model, self.device = stage.model, dist.device
        seed_everything(cfg.seed, dist.rank)

        # Data: the samplers fix the order from (seed, epoch); the loaders are rebuilt every epoch.
        self.train_sampler = _train_sampler(train_set, cfg, dist)
        self.val_sampler = _val_sampler(val_set, cfg, dist)
        samples_per_rank = self.train_sampler.samples_per_rank()
        if samples_per_rank < 1:
            raise ValueError(
                f"{stage.name}: {len(train_set)} training windows cannot be split over {dist.world_size} "
                "processes; add data or use fewer processes"
            )
        self.batch_sizes = micro_batch_sizes(samples_per_rank, cfg.batch_size)
        self.steps_per_epoch = optimizer_steps_per_epoch(samples_per_rank, cfg.batch_size, cfg.accumulation_steps)

        # Model, optimizer, schedule (OneCycle over every optimizer step of every epoch).
        self.model.to(self.device)
        self.clip = stage.default_clip if cfg.clip_grad_norm is None else cfg.clip_grad_norm
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda",
        )
        # cycle_momentum=False: OneCycleLR would otherwise overwrite AdamW's beta1 (0.85..0.95), ignoring cfg.betas.
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, max_lr=cfg.lr, total_steps=self.steps_per_epoch * cfg.epochs, pct_start=cfg.pct_start,
            div_factor=cfg.div_factor, final_div_factor=cfg.final_div_factor, cycle_momentum=False,
        )
        if cfg.amp == "bf16" and self.device.type != "cuda":
            warnings.warn("training.amp=bf16 needs CUDA; training in float32 on CPU")
        self.state = _LoopState()
        self.resume_path: Path | None = None
        self.wrapped: nn.Module = self.model
        self.logger = MetricsLogger(out, enabled=False)
        self.run_extra: dict[str, Any] = {}
        self.fault_step = int(os.environ.get(FAULT_ENV, "0") or 0)
        self.fault_rank = os.environ.get("KRONOS_FAULT_RANK")

    # ------------------------------------------------------------------------------------------------------------
    def resume(self) -> None:
        """Load checkpoints/last.pt per `training.resume`, then wrap the model for DDP (broadcasts rank 0's weights)."""
        self.resume_path = find_resume_checkpoint(self.cfg.resume, self.out)
        if self.resume_path is not None:
            barrier()  # no rank reads while rank 0 might still be writing
            saved = load_checkpoint(self.resume_path, map_location=self.device)
            _check_resume_compatible(saved, self.cfg, self.dist, self.stage.name, self.model, self.resume_path)
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            self.state = _LoopState(**saved["loop"])
            set_rng_state(saved["rng"][self.dist.rank])  # this rank's own python/numpy/torch streams
            if self.dist.is_main:
                tqdm.write(f"[{self.stage.name}] resuming from {self.resume_path} at step {self.state.global_step}")
        self.wrapped = _wrap(self.model, self.dist)

    def open_outputs(self) -> None:
        """metrics.jsonl and run_info.json (rank 0 only)."""
        cfg = self.cfg
        self.logger = MetricsLogger(
            self.out, enabled=self.dist.is_main, tensorboard=cfg.tensorboard, comet=cfg.comet,
            comet_project=cfg.comet_project, run_name=f"{self.out.name}-{self.stage.name}",
            resume_step=self.state.global_step if self.resume_path is not None else None,
        )
        self.run_extra = {"stage": self.stage.name, "world_size": self.dist.world_size,
                          "resumed_from": str(self.resume_path) if self.resume_path else None}
        if self.dist.is_main:
            write_run_info(self.out, self.run_config, self.data_info, self.run_extra)
            self.logger.log_params(self.run_config)

    # ------------------------------------------------------------------------------------------------------------
    def train_epoch(self) -> None:
        """One epoch (or its rest, after a mid-epoch resume) of optimizer steps."""
        cfg, state, device, stage = self.cfg, self.state, self.device, self.stage
        epoch, A = state.epoch, cfg.accumulation_steps
        self.epoch_start = time.perf_counter()
        self.model.train()
        loader = make_loader(
            self.train_set, self.train_sampler, cfg.batch_size, epoch=epoch, seed=cfg.seed,
            skip_batches=state.step_in_epoch * A, num_workers=cfg.num_workers, pin_memory=device.type == "cuda",
        )
        bar = tqdm(
            total=self.steps_per_epoch, initial=state.step_in_epoch,
            disable=not (self.dist.is_main and cfg.progress_bar),
            desc=f"{stage.name} epoch {epoch + 1}/{cfg.epochs}", dynamic_ncols=True, leave=False,
        )
        window = _Window(device)
        # (sum of loss * n, n) over the epoch; after a resume rank 0 carries the part done before the interruption.
        carried = [state.epoch_loss_sum, state.epoch_windows] if self.dist.is_main else [0.0, 0]
        self.epoch_sum = torch.tensor(carried, dtype=torch.float64, device=device)
        batch_index = state.step_in_epoch * A
        t_wait = time.perf_counter()
        for x, stamp in loader:
            window.data_wait += time.perf_counter() - t_wait
            x = x.to(device, non_blocking=True)  # (B, T, F)
            stamp = stamp.to(device, non_blocking=True)  # (B, T, 5)
            group = batch_index // A  # the optimizer step this micro-batch belongs to
            group_sizes = self.batch_sizes[group * A : (group + 1) * A]
            last_in_group = batch_index == group * A + len(group_sizes) - 1
            # Weight each micro-batch by its share of the step's windows, so the step's gradient is the mean over
            # all its windows also when the epoch's last micro-batch is smaller.
            weight = x.shape[0] / sum(group_sizes)
            with contextlib.nullcontext() if last_in_group else _no_sync(self.wrapped):  # sync once per step
                with _autocast(cfg, device):
                    loss, parts = stage.loss(self.wrapped, x, stamp, training=True)
                (loss * weight).backward()
            window.add(loss.detach(), parts, x.shape[0], x.shape[1])
            self.epoch_sum[0] += loss.detach().double() * x.shape[0]
            self.epoch_sum[1] += x.shape[0]
            batch_index += 1
            if last_in_group:
                grad_norm = self.optimizer_step()
                bar.update(1)
                window = self.after_step(window, grad_norm, bar)
            t_wait = time.perf_counter()
        bar.close()

    def optimizer_step(self) -> torch.Tensor | None:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip) if self.clip > 0 else None
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        self.state.step_in_epoch += 1
        return grad_norm

    def after_step(self, window: "_Window", grad_norm: torch.Tensor | None, bar) -> "_Window":
        """Log, checkpoint mid-epoch, and fire the test fault hook; returns the (possibly fresh) log window."""
        state, cfg = self.state, self.cfg
        end_of_epoch = state.step_in_epoch == self.steps_per_epoch
        if should_log(state.global_step, cfg.log_every_steps, end_of_epoch):
            record = window.reduce(self.dist)
            record.update(step=state.global_step, epoch=state.epoch, lr=self.scheduler.get_last_lr()[0])
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(
                    f"{self.stage.name}: training loss is {record['loss']} at step {state.global_step}; "
                    "lower training.lr or set training.amp=none"
                )
            self.logger.log({"kind": "train", **record})
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
            window = _Window(self.device)
        if not end_of_epoch and should_save_checkpoint(state.global_step, cfg.save_every_steps):
            self.save_last(self.epoch_sum)
        if self.fault_step == state.global_step and (self.fault_rank is None or int(self.fault_rank) == self.dist.rank):
            os._exit(int(os.environ.get("KRONOS_FAULT_EXIT_CODE", "17")))  # test hook: die like a killed job
        return window

    # ------------------------------------------------------------------------------------------------------------
    def end_epoch(self) -> None:
        """Validate, keep the best model, update early stopping, write last.pt."""
        state, cfg, stage, dist = self.state, self.cfg, self.stage, self.dist
        epoch = state.epoch
        train_loss = _reduced_mean(self.epoch_sum)
        val = _evaluate(stage, self.wrapped, self.val_set, self.val_sampler, cfg, dist, epoch)
        decision = update_early_stopping(
            state.best_val_loss, state.bad_epochs, val["val_loss"], cfg.patience, cfg.min_delta
        )
        if decision.improved:
            state.best_epoch = epoch
            if dist.is_main:
                stage.save_best(self.best_dir)
                write_run_info(self.best_dir, self.run_config, self.data_info,
                               {**self.run_extra, "epoch": epoch, "val_loss": val["val_loss"]})
            barrier()
        state.best_val_loss, state.bad_epochs = decision.best, decision.bad_epochs
        entry = {"epoch": epoch, "step": state.global_step, "train_loss": train_loss, **val,
                 "lr": self.scheduler.get_last_lr()[0], "seconds": time.perf_counter() - self.epoch_start}
        state.history.append(entry)
        self.logger.log({"kind": "val", **entry, "best_val_loss": state.best_val_loss, "improved": decision.improved})
        if dist.is_main:
            tqdm.write(
                f"[{stage.name}] epoch {epoch + 1}/{cfg.epochs}  train {train_loss:.4f}  val {val['val_loss']:.4f}"
                f"  best {state.best_val_loss:.4f}" + ("  (saved)" if decision.improved else "")
            )
        state.epoch, state.step_in_epoch = epoch + 1, 0
        state.epoch_loss_sum, state.epoch_windows = 0.0, 0
        state.stopped_early = decision.stop and state.epoch < cfg.epochs
        state.finished = decision.stop or state.epoch >= cfg.epochs
        self.save_last()

    def save_last(self, epoch_sum: torch.Tensor | None = None) -> None:
        """Write checkpoints/last.pt (rank 0; every rank's RNG state included), then wait for all ranks."""
        rngs = _gather_objects(rng_state(), self.dist)  # every rank resumes its own random stream
        if epoch_sum is not None:  # mid-epoch: keep the epoch's running training loss (all ranks)
            total = all_reduce_sum(epoch_sum.clone()).tolist()
            self.state.epoch_loss_sum, self.state.epoch_windows = total[0], int(total[1])
        if self.dist.is_main:
            atomic_torch_save(
                {
                    "format": CHECKPOINT_FORMAT,
                    "stage": self.stage.name,
                    "model": self.model.state_dict(),
                    "model_args": _plain(dict(getattr(self.model, "config", {}) or {})),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "grad_scaler": None,  # bf16 autocast needs no loss scaling
                    "loop": dataclasses.asdict(self.state),
                    "rng": rngs,
                    "world_size": self.dist.world_size,
                    "training_config": config_to_dict(self.cfg),
                    "run_config": _plain(self.run_config),
                },
                self.ckpt_path,
            )
        barrier()

    # ------------------------------------------------------------------------------------------------------------
    def finish(self) -> TrainResult:
        """Loss plot and final run_info.json (rank 0), then the result."""
        state = self.state
        plot_path = self.out / "loss_curve.png"
        if self.dist.is_main:
            title = f"{self.stage.name} finetuning"
            if plot_loss_curves(read_metrics(self.logger.path), plot_path, title=title) is None:
                plot_path = None
            result = {"best_val_loss": state.best_val_loss, "best_epoch": state.best_epoch,
                      "global_step": state.global_step, "stopped_early": state.stopped_early}
            write_run_info(self.out, self.run_config, self.data_info, {**self.run_extra, "result": result})
        barrier()
        return TrainResult(
            stage=self.stage.name,
            best_val_loss=state.best_val_loss,
            best_epoch=state.best_epoch,
            output_dir=self.out,
            best_model_dir=self.best_dir,
            last_checkpoint=self.ckpt_path,
            metrics_path=self.logger.path,
            plot_path=plot_path if plot_path is not None and plot_path.exists() else None,
            run_info_path=self.out / "run_info.json",
            history=list(state.history),
            global_step=state.global_step,
            stopped_early=state.stopped_early,
            resumed_from=self.resume_path,
        )


def _evaluate(
    stage: _Stage,
    wrapped: nn.Module,
    dataset: Dataset,
    sampler: EpochSampler,
    cfg: TrainingConfig,
    dist: DistInfo,
    epoch: int,
) -> dict[str, float]:
    """Loss averaged over every validation window of all ranks: sums and counts are all-reduced, not batch means."""
    was_training = stage.model.training
    stage.model.eval()
    loader = make_loader(dataset, sampler, cfg.batch_size, epoch=epoch, seed=cfg.seed + 1, num_workers=cfg.num_workers,
                         pin_memory=dist.device.type == "cuda")
    sums: torch.Tensor | None = None  # (1 + n_parts,) float64: sum of per-window losses
    count = torch.zeros(1, dtype=torch.float64, device=dist.device)
    names: list[str] = []
    with torch.no_grad():
        for x, stamp in loader:
            x, stamp = x.to(dist.device, non_blocking=True), stamp.to(dist.device, non_blocking=True)
            with _autocast(cfg, dist.device):
                loss, parts = stage.loss(wrapped, x, stamp, training=False)
            names = list(parts)
            values = torch.stack([loss.detach().double(), *[v.double() for v in parts.values()]]) * x.shape[0]
            sums = values if sums is None else sums + values
            count += x.shape[0]
    if sums is None:  # this rank got no window (fewer windows than ranks): still join the all-reduce
        names = _part_names(stage)
        sums = torch.zeros(1 + len(names), dtype=torch.float64, device=dist.device)
    totals = all_reduce_sum(torch.cat([sums, count]))
    n = totals[-1].item()
    means = (totals[:-1] / max(n, 1.0)).tolist()
    stage.model.train(was_training)
    return {"val_loss": means[0], **{f"val_{k}": v for k, v in zip(names, means[1:])}, "val_windows": int(n)}


def _part_names(stage: _Stage) -> list[str]:
    return ["recon_pre", "recon", "bsq"] if stage.name == "tokenizer" else ["s1_loss", "s2_loss"]


class _Window:
    """Accumulates losses and timings between two log records, on the device (no per-step host sync)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: torch.Tensor | None = None
        self.names: list[str] = []
        self.samples = 0
        self.window_len = 0
        self.data_wait = 0.0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, parts: dict[str, torch.Tensor], n: int, window_len: int) -> None:
        self.names = list(parts)
        self.window_len = window_len
        values = torch.stack([loss.double(), *[v.double() for v in parts.values()]]) * n
        self.sums = values if self.sums is None else self.sums + values
        self.samples += n

    def reduce(self, dist: DistInfo) -> dict[str, float]:
        """All-reduce and turn into a record: mean losses over all ranks' windows, throughput, data wait."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        extra = torch.tensor([self.samples, self.data_wait], dtype=torch.float64, device=self.device)
        totals = all_reduce_sum(torch.cat([self.sums, extra])).tolist()
        samples = totals[-2]
        record = {"loss": totals[0] / samples}
        record.update({k: v / samples for k, v in zip(self.names, totals[1:-2])})
        record["samples_per_s"] = samples / seconds
        record["tokens_per_s"] = samples * self.window_len / seconds  # candles (= token pairs) per second
        record["data_wait_s"] = totals[-1] / dist.world_size  # mean over ranks
        record["seconds"] = seconds
        return record


def _reduced_mean(sum_count: torch.Tensor) -> float:
    total = all_reduce_sum(sum_count.clone())
    return (total[0] / total[1]).item() if total[1] > 0 else math.nan


def _gather_objects(obj: Any, dist: DistInfo) -> list[Any]:
    if not dist.distributed:
        return [obj]
    import torch.distributed as tdist

    out: list[Any] = [None] * dist.world_size
    tdist.all_gather_object(out, obj)
    return out


def _plain(obj: Any) -> Any:
    """Config data reduced to str/int/float/bool/None/list/dict (so the checkpoint loads with weights_only=True)."""
    obj = config_to_dict(obj)
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)

