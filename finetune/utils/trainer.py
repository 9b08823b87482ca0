"""The training loop behind both stages: `Trainer(stage, train_set, val_set, cfg, out, dist, ...).fit()`.

    fit():   [GracefulStop, RunLock] plan_folder (resume / skip / overwrite / refuse) -> resume -> open_outputs
             -> validate_start (epoch 0 = the starting model) -> per epoch: train_epoch + end_epoch -> finish
    train_step:  forward_backward_step per micro-batch (DDP syncs on the last) -> optimizer_step -> after_step
    optimizer_step: clip, non-finite guard + stop request (one all-reduce, BEFORE the update), update
    after_step:  log the window, graceful stop (save + TrainingStopped), mid-epoch checkpoint, test fault hook
    end_epoch:   validate (+ val_metric), keep the best model, early stopping, checkpoint

Epochs are numbered the same everywhere (logs, metrics.jsonl, history, TrainResult): 0 = the starting model
(validated before the first step), 1.. = trained epochs. `LoopState.epoch` counts the epochs done.

Why a class whose whole state is declared in `__init__` (torchtitan style) rather than one `fit()` function
(litgpt style): a run is checkpointed from inside the step loop and resumed mid-epoch, so the loop counters, the
running loss sums, the optimizer and the schedule are read and written at several points (step, log, checkpoint,
validation, resume). As attributes declared in one place they are visibly "the run's state", each method reads on
its own, and `save_last` / `resume` show exactly what survives an interruption (`LoopState` + tensors). One `fit()`
would have to pass that same state to closures or repeat it in a dozen locals. Nothing is created outside
`__init__`: methods only update the attributes it declares (tests/test_engine_helpers.py checks it).
The file is over 400 lines because the loop's steps are kept together, in the order they run; the run-safety
decisions it calls live in stage_folder.py / resume.py / guard.py / interrupts.py / checkpoint_store.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .checkpoint import (
    CHECKPOINT_FORMAT,
    last_checkpoint_path,
    rng_state,
    set_rng_state,
)
from .config_utils import Problems, config_to_dict
from .data.window_dataset import EpochSampler, make_loader, seed_worker
from .distributed import DistInfo, all_gather_object, barrier, no_sync, wrap_model
from .logging_setup import stage_log
from .loss_sums import LossSums
from .metrics import MetricsLogger, loss_plot_title, plot_loss_curves, read_metrics
from .provenance import write_run_info
from .run_state import LoopState, TrainResult
from .safety import checkpoint_store
from .safety.faults import maybe_die_after_step
from .safety.guard import NonFiniteGuard, assert_finite_state_dict
from .safety.interrupts import GracefulStop, TrainingStopped, ignore_interrupts_in_worker
from .safety.resume import check_data, load_for_resume, on_main, restore_optimizer, rng_fork
from .safety.run_lock import RunLock
from .safety.stage_folder import RunPlan, data_fingerprint, plan_run, remove_outputs
from .schedule import (
    micro_batch_sizes,
    optimizer_steps_per_epoch,
    should_log,
    should_save_checkpoint,
    step_batch_sizes,
    update_early_stopping,
)
from .seeding import seed_everything
from .stages import Stage
from .training_config import (
    TrainingConfig,
    check_resume_compatible,
    plain,
    validate_training_config,
)

__all__ = ["Trainer", "evaluate", "train_sampler", "val_sampler", "autocast", "ValMetric"]

log = logging.getLogger(__name__)

ValMetric = Callable[[nn.Module, Stage], dict[str, float]]
"""(model, stage) -> {"score": lower is better, other named values...}; called on every rank after validation."""


def _worker_init(worker_id: int) -> None:
    """DataLoader workers: reproducible seeds, and Ctrl-C left to the training process (graceful stop)."""
    seed_worker(worker_id)
    ignore_interrupts_in_worker(worker_id)


def quiet_loader(loader):
    """The loader with workers that ignore SIGINT (make_loader's seeding kept)."""
    if loader.num_workers > 0:
        loader.worker_init_fn = _worker_init
    return loader


def train_sampler(dataset: Dataset, cfg: TrainingConfig, dist: DistInfo) -> EpochSampler:
    """Shuffled per (seed, epoch), capped at max_train_samples, equal share per rank (the remainder dropped)."""
    return EpochSampler(
        len(dataset), shuffle=True, seed=cfg.seed, max_samples=cfg.max_train_samples,
        rank=dist.rank, world_size=dist.world_size, drop_remainder=True,
    )


def val_sampler(dataset: Dataset, cfg: TrainingConfig, dist: DistInfo) -> EpochSampler:
    """Ordered, nothing dropped or duplicated (an exact loss); a capped run draws a seeded subset per epoch."""
    return EpochSampler(
        len(dataset), shuffle=False, seed=cfg.seed + 1, max_samples=cfg.max_val_samples,
        rank=dist.rank, world_size=dist.world_size, drop_remainder=False,
    )


def autocast(cfg: TrainingConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when training.amp=bf16; nothing otherwise."""
    if cfg.amp == "bf16" and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(stage: Stage, wrapped: nn.Module, dataset: Dataset, sampler: EpochSampler, cfg: TrainingConfig,
             dist: DistInfo, epoch: int) -> dict[str, float]:
    """Validation loss of `stage` over every window `sampler` deals (all ranks), in eval mode.

    Returns {"val_loss", "val_<part>" for each of stage.part_names, "val_windows"}: window-weighted means over all
    ranks (sums and counts all-reduced, not batch means). A rank with no window still joins the all-reduce.
    """
    was_training = stage.model.training
    stage.model.eval()
    loader = quiet_loader(make_loader(dataset, sampler, cfg.batch_size, epoch=epoch, seed=cfg.seed + 1,
                                      num_workers=cfg.num_workers, pin_memory=dist.device.type == "cuda"))
    sums = LossSums(stage.part_names, dist.device)
    for x, stamp in loader:
        # x (B, T, F), stamp (B, T, 5)
        x, stamp = x.to(dist.device, non_blocking=True), stamp.to(dist.device, non_blocking=True)
        with autocast(cfg, dist.device):
            loss, parts = stage.loss(wrapped, x, stamp, training=False)
        sums.add(loss, parts, x.shape[0])
    totals = sums.reduce()
    stage.model.train(was_training)
    return {**totals.means(prefix="val_"), "val_windows": totals.windows}


class Trainer:
    """One training run of one stage. Build it, call `fit()` once.

    Parameters
    ----------
    stage: what is trained and how its loss is computed (`TokenizerStage` / `PredictorStage`).
    train_set, val_set: datasets of (x (T, F) float32, x_stamp (T, 5) int64) items.
    cfg: loop settings (validated here: a ConfigError lists every problem).
    out: the stage's output folder (written by rank 0 only).
    dist: from `distributed_context()`.
    run_config, data_info: stored in run_info.json and the checkpoint; data_info's fingerprint guards a resume
        (what it must hold: training_utils.py).
    val_metric: optional forecast metric (model, stage) -> {"score", ...}, run after each validation; with
        training.select_by = its name, its "score" (lower is better) picks best_model/ instead of val_loss.
    data_extremes: what the data check flagged (for the divergence diagnosis), or None.
    """

    def __init__(self, stage: Stage, train_set: Dataset, val_set: Dataset, cfg: TrainingConfig, out: Path,
                 dist: DistInfo, run_config: dict[str, Any] | None = None, data_info: dict[str, Any] | None = None,
                 val_metric: ValMetric | None = None, data_extremes: str | None = None):
        problems = Problems()
        validate_training_config(cfg, problems)
        problems.check(cfg.select_by == "loss" or val_metric is not None, "training.select_by",
                       f"{cfg.select_by!r} needs a forecast metric this pipeline does not provide; use 'loss'")
        problems.raise_if_any()
        # The one place the global random streams are set (see seeding.py): dropout and sampled tokens of this run
        # depend on (seed, rank) only.
        seed_everything(cfg.seed, dist.rank)

        self.stage, self.cfg, self.out, self.dist = stage, cfg, Path(out), dist
        self.model, self.device = stage.model, dist.device
        self.train_set, self.val_set = train_set, val_set
        self.run_config = run_config if run_config is not None else {"training": config_to_dict(cfg)}
        self.data_info = data_info
        self.val_metric = val_metric
        self.frozen_fp = stage.frozen_fingerprint()  # the predictor's tokenizer weights (None for the tokenizer)
        self.best_dir, self.ckpt_path = self.out / "best_model", last_checkpoint_path(self.out)

        # Data: the samplers fix the order from (seed, epoch); the loaders are rebuilt every epoch.
        self.train_sampler = train_sampler(train_set, cfg, dist)
        self.val_sampler = val_sampler(val_set, cfg, dist)
        samples_per_rank = self.train_sampler.samples_per_rank()
        if samples_per_rank < 1:
            raise ValueError(
                f"{stage.name}: {len(train_set)} training windows cannot be split over {dist.world_size} "
                "processes; add data or use fewer processes"
            )
        self.batch_sizes = micro_batch_sizes(samples_per_rank, cfg.batch_size)  # this rank's micro-batches per epoch
        self.steps_per_epoch = optimizer_steps_per_epoch(samples_per_rank, cfg.batch_size, cfg.accumulation_steps)

        # Model, optimizer, schedule (OneCycle over every optimizer step of every epoch).
        self.model.to(self.device)
        self.clip = stage.default_clip if cfg.clip_grad_norm is None else cfg.clip_grad_norm
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.optimizer.zero_grad(set_to_none=True)  # a model reused after a failed run may hold (NaN) gradients
        # cycle_momentum=False: OneCycleLR would otherwise overwrite AdamW's beta1 (0.85..0.95), ignoring cfg.betas.
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, max_lr=cfg.lr, total_steps=self.steps_per_epoch * cfg.epochs, pct_start=cfg.pct_start,
            div_factor=cfg.div_factor, final_div_factor=cfg.final_div_factor, cycle_momentum=False,
        )
        if cfg.amp == "bf16" and self.device.type != "cuda":
            warnings.warn("training.amp=bf16 needs CUDA; training in float32 on CPU", stacklevel=2)

        # Run safety: one run per folder (rank 0 holds the lock), signals -> graceful stop, non-finite guard.
        self.lock = RunLock(self.out, enabled=dist.is_main, key="the stage's output folder (output_dir)",
                            log=log.warning)
        self.stopper = GracefulStop(enabled=False)  # the real one is entered in fit()
        self.guard = NonFiniteGuard(amp=cfg.amp == "bf16" and self.device.type == "cuda", dist=dist,
                                    data_extremes=data_extremes)
        self.stop_agreed = False  # some rank received SIGTERM/SIGINT: stop after this step
        self.step_loss = torch.zeros((), device=self.device)  # the current optimizer step's loss (weighted mean)
        self.plan = RunPlan("fresh")

        # Run state: replaced by the checkpoint's in resume(); updated by the steps.
        self.state = LoopState()
        self.resume_path: Path | None = None
        self.wrapped: nn.Module = self.model  # the DDP wrapper once resume() ran (the model itself in one process)
        self.logger = MetricsLogger(self.out, enabled=False)  # the real one is opened in open_outputs()
        self.run_extra: dict[str, Any] = {}  # stage, world size, resumed_from: added to every run_info.json
        self.bar = tqdm(disable=True)  # this epoch's progress bar (rank 0 with training.progress_bar)
        self.epoch_start = time.perf_counter()
        self.epoch_sums = LossSums(stage.part_names, self.device)  # the epoch's training loss so far
        self.window = LossSums(stage.part_names, self.device)  # training loss since the last log record
        self.window_start = time.perf_counter()
        self.window_data_wait = 0.0  # seconds this rank waited for the loader in the window
        self.window_len = 0  # T of the last batch: tokens/s = windows/s * T
        self.grad_norm: torch.Tensor | None = None  # of the last optimizer step (None without clipping)

    # ------------------------------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Take the folder, decide (resume / skip / overwrite), train the remaining epochs, write the final outputs.

        Raises TrainingStopped after saving on SIGTERM/SIGINT, DivergenceError on a non-finite step (nothing of it
        applied, the last checkpoint kept), RunLockedError / StageFolderError / ConfigError on every rank when the
        folder or settings refuse the run.
        """
        with GracefulStop() as self.stopper:
            try:
                self.take_folder()
                if self.plan.action == "skip":
                    return self.read_finished()
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
            except BaseException:
                self.logger.close(failed=True)  # an MLflow run is marked FAILED, metrics.jsonl is flushed
                raise
            finally:
                self.logger.close()
                self.lock.release()

    def take_folder(self) -> None:
        """Rank 0 locks the stage folder, decides what to do with what it holds, deletes replaced outputs and
        leftovers of killed writes (under the lock); every rank gets the decision or the same error."""

        def decide() -> RunPlan:
            self.lock.acquire()
            plan = plan_run(self.out, self.cfg.resume, self.cfg.overwrite, self.stage.name)
            if plan.message:
                log.info("%s", plan.message)
            remove_outputs(self.out, plan.remove)
            checkpoint_store.prepare_folder(self.out, log=log.warning)
            checkpoint_store.prepare_folder(self.ckpt_path.parent, log=log.warning)
            return plan

        self.plan = on_main(decide, self.dist)

    def read_finished(self) -> TrainResult:
        """A finished run is not retrained: its final checkpoint's weights go into the model, its result is returned."""
        found = load_for_resume(self.plan, self.dist, log.warning)
        if found is None:
            raise ValueError(f"{self.out}: run_info.json says finished but no checkpoint is left")
        self.resume_path, saved = found
        # A finished run made with other epochs / batch / model settings is not "this" run: say so, not skip.
        check_resume_compatible(saved, self.cfg, self.dist.world_size, self.stage.name, self.model_args(),
                                self.resume_path)
        self.model.load_state_dict(saved["model"])
        loop = dict(saved["loop"])
        loop.setdefault("best_score", loop.get("best_val_loss", math.inf))
        self.state = LoopState(**loop)
        plot = self.out / "loss_curve.png"
        return self.result(plot if plot.exists() else None, skipped=True)

    def resume(self) -> None:
        """Load the newest usable checkpoint when the plan says resume, then wrap the model for DDP (broadcasts rank
        0's weights). A resume may change optimisation settings (each named in one line) but not the data order,
        shapes, data or frozen tokenizer (unless training.accept_changed_data)."""
        found = load_for_resume(self.plan, self.dist, log.warning) if self.plan.action == "resume" else None
        if found is not None:
            self.resume_path, saved = found
            changed = check_resume_compatible(saved, self.cfg, self.dist.world_size, self.stage.name,
                                              self.model_args(), self.resume_path)
            accepted = check_data(saved, self.data_info, self.frozen_fp, self.cfg.accept_changed_data,
                                  self.resume_path)
            self.model.load_state_dict(saved["model"])
            restore_optimizer(self.optimizer, self.scheduler, saved)
            loop = dict(saved["loop"])
            loop.setdefault("best_score", loop.get("best_val_loss", math.inf))
            self.state = LoopState(**loop)
            set_rng_state(saved["rng"][self.dist.rank])  # this rank's own python/numpy/torch streams
            self.run_extra = {"changed_on_resume": changed, "accepted_changed_data": accepted}
            if self.dist.is_main:
                log.info("[%s] resuming from %s at step %d", self.stage.name, self.resume_path, self.state.global_step)
                if changed:
                    log.info("[%s] settings changed since the checkpoint: %s", self.stage.name, "; ".join(changed))
                for text in accepted:
                    log.warning("[%s] training.accept_changed_data=true: %s", self.stage.name, text)
        self.wrapped = wrap_model(self.model, self.dist)

    def open_outputs(self) -> None:
        """metrics.jsonl and run_info.json (rank 0 only)."""
        cfg = self.cfg
        self.logger = MetricsLogger(
            self.out, enabled=self.dist.is_main, tensorboard=cfg.tensorboard, mlflow=cfg.mlflow,
            mlflow_tracking_uri=cfg.mlflow_tracking_uri, mlflow_experiment=cfg.mlflow_experiment, comet=cfg.comet,
            comet_project=cfg.comet_project, run_name=f"{self.out.name}-{self.stage.name}",
            resume_step=self.state.global_step if self.resume_path is not None else None,
        )
        self.run_extra = {"stage": self.stage.name, "world_size": self.dist.world_size, "select_by": cfg.select_by,
                          "resumed_from": str(self.resume_path) if self.resume_path else None,
                          **{k: v for k, v in self.run_extra.items() if v}}
        if self.dist.is_main:
            write_run_info(self.out, self.run_config, self.data_info, self.run_extra)
            self.logger.log_params(self.run_config)

    def validate_start(self) -> None:
        """Epoch 0: validate the starting model before the first step; it is best_model/ until an epoch beats it.
        The random streams are restored afterwards, so training is the same as without this validation."""
        self.epoch_start = time.perf_counter()
        with rng_fork():
            self.validate_and_select(epoch=0, train_loss=None)

    # ------------------------------------------------------------------------------------------------------------
    def train_epoch(self) -> None:
        """The epoch's optimizer steps (or the rest of them, after a mid-epoch resume)."""
        cfg, state = self.cfg, self.state
        self.epoch_start = time.perf_counter()
        self.model.train()
        loader = quiet_loader(make_loader(
            self.train_set, self.train_sampler, cfg.batch_size, epoch=state.epoch, seed=cfg.seed,
            skip_batches=state.step_in_epoch * cfg.accumulation_steps, num_workers=cfg.num_workers,
            pin_memory=self.device.type == "cuda",
        ))
        # After a resume rank 0 carries the (all ranks') sum of the part of the epoch done before the interruption.
        carried = (state.epoch_loss_sum, state.epoch_windows) if self.dist.is_main else (0.0, 0)
        self.epoch_sums = LossSums(self.stage.part_names, self.device, *carried)
        self.reset_window()
        show_bar = self.dist.is_main and cfg.progress_bar
        self.bar = tqdm(total=self.steps_per_epoch, initial=state.step_in_epoch, disable=not show_bar,
                        desc=f"{self.stage.name} epoch {state.epoch + 1}/{cfg.epochs}", dynamic_ncols=True,
                        leave=False)
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
        gradients only when `sync` (the step's last micro-batch). The loss goes into the window and epoch sums."""
        with contextlib.nullcontext() if sync else no_sync(self.wrapped):
            with autocast(self.cfg, self.device):
                loss, parts = self.stage.loss(self.wrapped, x, stamp, training=True)
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
        self.window = LossSums(self.stage.part_names, self.device)
        self.window_start = time.perf_counter()
        self.window_data_wait = 0.0

    def log_window(self) -> None:
        """One metrics.jsonl "train" record: the window's mean losses over all ranks, throughput, loader wait."""
        seconds = max(time.perf_counter() - self.window_start, 1e-9)
        totals = self.window.reduce(extra=[self.window_data_wait])
        record = totals.means()
        record["samples_per_s"] = totals.windows / seconds
        record["tokens_per_s"] = totals.windows * self.window_len / seconds  # candles (= token pairs) per second
        record["data_wait_s"] = totals.extra[0] / self.dist.world_size  # mean over ranks
        record["seconds"] = seconds
        record.update(step=self.state.global_step, epoch=self.state.epoch + 1, lr=self.scheduler.get_last_lr()[0])
        if self.grad_norm is not None:
            record["grad_norm"] = float(self.grad_norm)
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(
                f"{self.stage.name}: training loss is {record['loss']} at step {self.state.global_step}; "
                "lower training.lr or set training.amp=none"
            )
        self.logger.log({"kind": "train", **record})
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        self.reset_window()

    # ------------------------------------------------------------------------------------------------------------
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
        state, cfg, stage, dist = self.state, self.cfg, self.stage, self.dist
        # The sampler's epoch (a fresh subset per epoch under max_val_samples): epoch 0 shares epoch 1's.
        val = evaluate(stage, self.wrapped, self.val_set, self.val_sampler, cfg, dist, max(epoch - 1, 0))
        score = val["val_loss"]
        if self.val_metric is not None:
            with rng_fork():  # a sampled forecast metric must not move the training's random streams
                metric = self.val_metric(self.model, stage)
            val.update({f"metric_{k}": float(v) for k, v in metric.items()})
            if cfg.select_by != "loss":
                score = float(metric["score"])
        decision = update_early_stopping(state.best_score, state.bad_epochs, score, cfg.patience, cfg.min_delta)
        if decision.improved:
            state.best_epoch, state.best_val_loss = epoch, val["val_loss"]
            if dist.is_main:
                self.save_best(epoch, val["val_loss"])
            barrier()
        state.best_score, state.bad_epochs = decision.best, (0 if epoch == 0 else decision.bad_epochs)
        entry = {"epoch": epoch, "step": state.global_step, "train_loss": train_loss, **val, "score": score,
                 "lr": self.scheduler.get_last_lr()[0], "seconds": time.perf_counter() - self.epoch_start}
        state.history.append(entry)
        self.logger.log({"kind": "val", **entry, "best_val_loss": state.best_val_loss, "best_score": state.best_score,
                         "improved": decision.improved})
        if dist.is_main:
            what = "starting model" if epoch == 0 else f"epoch {epoch}/{cfg.epochs}  train {train_loss:.4f}"
            log.info("[%s] %s  val %.4f%s  best %.4f%s", stage.name, what, val["val_loss"],
                     f"  {cfg.select_by} {score:.4f}" if cfg.select_by != "loss" else "", state.best_score,
                     "  (saved)" if decision.improved else "")
        return decision.stop and epoch > 0

    def save_best(self, epoch: int, val_loss: float) -> None:
        """best_model/ in the published format plus its run_info.json (rank 0); never non-finite weights, and a
        full disk is reported with the folder, free space and bytes needed."""
        assert_finite_state_dict(self.model.state_dict(), str(self.best_dir))
        try:
            self.stage.save_best(self.best_dir)
            write_run_info(self.best_dir, self.run_config, self.data_info,
                           {**self.run_extra, "epoch": epoch, "val_loss": val_loss})
        except OSError as e:
            if checkpoint_store.is_space_error(e):
                needed = checkpoint_store.estimate_bytes(self.model.state_dict())
                raise checkpoint_store.space_error(self.best_dir / "model.safetensors", needed, e) from e
            raise

    def save_last(self, mid_epoch: bool = False) -> None:
        """Write checkpoints/last.pt (rank 0; every rank's RNG state included), then wait for all ranks.

        `mid_epoch`: also store the epoch's running training loss (all ranks' sums) so a resumed epoch reports the
        same mean as an uninterrupted one.
        """
        rngs = all_gather_object(rng_state())  # every rank resumes its own random stream
        if mid_epoch:
            totals = self.epoch_sums.reduce()
            self.state.epoch_loss_sum, self.state.epoch_windows = totals.sums["loss"], totals.windows
        if self.dist.is_main:
            checkpoint_store.save(
                {
                    "format": CHECKPOINT_FORMAT,
                    "stage": self.stage.name,
                    "model": self.model.state_dict(),
                    "model_args": self.model_args(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "grad_scaler": None,  # bf16 autocast needs no loss scaling
                    "loop": dataclasses.asdict(self.state),
                    "rng": rngs,
                    "world_size": self.dist.world_size,
                    "training_config": config_to_dict(self.cfg),
                    "run_config": plain(self.run_config),
                    "data_info": plain(self.data_info),
                    "data_fingerprint": data_fingerprint(plain(self.data_info)),
                    "frozen_fingerprint": self.frozen_fp,
                },
                self.ckpt_path.parent, self.state.global_step, keep=self.cfg.keep_checkpoints, log=log.warning,
            )
        barrier()

    def model_args(self) -> dict[str, Any]:
        """The model's constructor arguments as plain data (checkpoint's "model_args")."""
        return plain(dict(getattr(self.model, "config", {}) or {}))

    # ------------------------------------------------------------------------------------------------------------
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
        """The TrainResult of the loop state."""
        state = self.state
        return TrainResult(
            stage=self.stage.name,
            best_val_loss=state.best_val_loss,
            best_epoch=state.best_epoch,
            output_dir=self.out,
            best_model_dir=self.best_dir,
            last_checkpoint=self.ckpt_path,
            metrics_path=self.out / "metrics.jsonl",
            plot_path=plot_path,
            run_info_path=self.out / "run_info.json",
            history=list(state.history),
            global_step=state.global_step,
            stopped_early=state.stopped_early,
            resumed_from=self.resume_path,
            best_score=state.best_score,
            skipped=skipped,
        )
