"""The CSV pipeline's side of the engine's stage runner (finetune/utils/stages.py): `CsvPipeline` (its data store,
splits and windows, the predictor's tokenizer), and what only this pipeline scores with: the CRPS checkpoint metric
(`make_crps_val_metric`, as the IC metric lives in the Qlib pipeline) and the conformal calibration of the bands."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import torch

import model.calibration as conformal
import model.predictor as forecaster
from finetune.evaluation.held_out import HeldOutWindows, held_out_windows, sample_paths, spread_evenly, window_crps_mae
from finetune.utils.distributed import DistInfo, barrier
from finetune.utils.ledger import stage_status
from finetune.utils.safety import raise_if_stop_requested
from finetune.utils.schema import STAGES
from finetune.utils.validate import ValMetric
from finetune.utils.windows import PanelSegments
from finetune_csv.config import CsvFinetuneConfig, best_dir
from finetune_csv.prepare import PreparedData, data_summary_from_store, prepare_data
from finetune_csv.splits import build_dataset
from model import KronosTokenizer
from model.config import Window
from model.errors import ConfigError, DataError
from model.features import CLOSE
from model.fileio import check_seal, seal, write_json
from model.predictor import CALIBRATION_FAILED as FAILED_KEY

log = logging.getLogger("finetune_csv")

class CsvPipeline:
    """The CSV pipeline's side of the stage runner (finetune/utils/stages.py): its data store, splits and
    windows, the tokenizer its predictor trains with, the CRPS metric and the calibration of the bands."""

    def __init__(self, cfg: CsvFinetuneConfig, frames: Mapping[str, pd.DataFrame] | None = None,
                 splits: dict[str, PanelSegments] | None = None):
        self.cfg, self.frames, self.splits = cfg, frames, splits
        self.plan: dict[str, str | None] = {}
        self.data: PreparedData | None = None  # once `datasets` prepared it

    def stage_dir(self, stage: str) -> Path:
        return self.cfg.tokenizer_dir if stage == "tokenizer" else self.cfg.predictor_dir

    def output_key(self, stage: str) -> str:
        return "paths.base_dir"

    def datasets(self, dist: DistInfo) -> tuple:
        """Rank 0 parses and checks every file into the store (or reuses it), the others wait; every rank maps it
        read-only (one page-cache copy per machine); the splits are index ranges, nothing is copied."""
        cfg = self.cfg
        data = prepare_data(cfg.data, cfg.store_dir, dist=dist, barrier=barrier, frames=self.frames,
                            with_splits=self.splits is None)
        if self.splits is not None:
            data = dataclasses.replace(data, splits={k: dataclasses.replace(v, panel=data.panel)
                                                     for k, v in self.splits.items()})
        self.data = data
        data_info = data_summary_from_store(data, cfg.data)
        if dist.is_main:
            log.info("%s", describe(cfg, data_info, self.plan, dist, data))
        return build_dataset(data.splits["train"], cfg.data), build_dataset(data.splits["val"], cfg.data), data_info

    def tokenizer_source(self) -> tuple[str, str]:
        """The finetuned tokenizer once it exists, else `model.pretrained_tokenizer` (the tokenizer stage never ran,
        e.g. --skip-tokenizer); also what `kronos forecast` compares with. An interrupted tokenizer stage and a
        from-scratch tokenizer never trained are errors, not a silent half-trained or random one."""
        cfg = self.cfg
        folder, finetuned = Path(cfg.tokenizer_dir), best_dir(cfg.tokenizer_dir)
        if stage_status(folder) == "unfinished" and any(
                (folder / name).exists() for name in ("checkpoints", "run_info.json", "metrics.jsonl")):
            raise DataError(f"the tokenizer stage in {folder} is unfinished: run it to the end first (drop "
                            "--skip-tokenizer; it resumes where it stopped) or use another paths.base_dir")
        if (finetuned / "config.json").is_file():  # a finished stage's model, or one placed there by hand
            return str(finetuned), "paths.base_dir"
        if cfg.model.pretrained_tokenizer is not None:
            return cfg.model.pretrained_tokenizer, "model.pretrained_tokenizer"
        raise ConfigError([f"model.pretrained_tokenizer: is null and there is no trained tokenizer in {finetuned}: "
                           "train the tokenizer first (drop --skip-tokenizer) or set model.pretrained_tokenizer"])

    def val_metric(self, select_by: str, tokenizer):
        """select_by crps: sampled forecasts of the validation split's non-overlapping windows."""
        if select_by != "crps":
            return None
        return make_crps_val_metric(self.cfg, held_out_windows(self.data.splits["val"], self.cfg.data.window),
                                    tokenizer)

    def calibrate(self, best: Path) -> dict | None:
        """forecast.calibrate: conformal bands of the predictor in `best` fitted on the validation windows."""
        d, f = self.cfg.data, self.cfg.forecast
        if not f.calibrate:
            return None
        windows = held_out_windows(self.data.splits["val"], d.window, f.window_stride)
        raise_if_stop_requested("before calibrating the predictor's bands")
        return calibrate(best, windows, f, d.window)


def describe(cfg: CsvFinetuneConfig, data_info: dict, plan: dict[str, str | None], dist: DistInfo,
             data: PreparedData) -> str:
    """The run at a glance: data (and whether its store was prepared or reused), splits, stages, processes."""
    splits = data_info["splits"]
    lines = [f"{len(data_info['series'])} series from {len(data_info['files'])} file(s) under {cfg.data.path}; "
             f"windows of {cfg.data.lookback} + {cfg.data.predict} candles, stride {cfg.data.stride}"]
    how = data_info.get("split") or {}
    if how.get("mode") == "by_date":
        lines.append(f"  split by date (data.split: by_date): validation from {how['train_end']}"
                     + (f", test from {how['val_end']}" if how.get("val_end") else "")
                     + f"; training targets end data.predict = {cfg.data.predict} bars before each boundary")
    elif how:
        lines.append("  split per series (data.split: per_series): each series by its own row ratios")
    lines.append(f"  data store {data.store.path} ({'reused: ' if data.store.reused else 'prepared: '}"
                 f"{data.store.reason})")
    for name, s in splits.items():
        lines.append(f"  {name:<5} {s['rows']:>9,} rows {s['windows']:>9,} windows  {s['start']} .. {s['end']}")
    for stage in STAGES:  # a finished stage under resume auto/required is reused (the ledger), not trained
        t, folder = cfg.stage_training(stage), cfg.tokenizer_dir if stage == "tokenizer" else cfg.predictor_dir
        reuse = plan[stage] is None and not t.overwrite and t.resume.strip().lower() in ("auto", "required") and \
            stage_status(folder) == "finished"
        lines.append(f"  {stage}: " + (f"reuse the finished run in {folder} if current for these settings and data "
                                       "(else refused, naming what changed; --overwrite trains it again)" if reuse
                                       else "train" if plan[stage] is None else f"skipped ({plan[stage]})"))
    lines.append(f"  {dist.world_size} process(es) on {dist.device}; outputs in {cfg.base_dir}")
    return "\n".join(lines)


def calibrate(best: Path, windows: HeldOutWindows, sampling: Any, window: Window) -> dict | None:
    """Fit the bands of the predictor in `best` (with the tokenizer it was trained with) on held-out VALIDATION
    `windows` (`model.calibration.fit_windows`; the test windows stay untouched: a forecast's coverage is out of sample)
    under `sampling` (forecast.*), stored in its kronos_predictor.json; when no window is left, FAILED_KEY {"reason",
    "series", "advice"} in its place. Returns the calibration (None when there is no window or none is left)."""
    if len(windows) == 0:
        log.warning("no calibration: the validation split has no %d-bar window (raise data.val_ratio)", window.size)
        return None
    model, tokenizer, _ = forecaster.load_trained_pair(best)  # not from_pretrained: it warns "never calibrated"
    paths = sample_paths(forecaster.KronosPredictor.from_models(model, tokenizer, window=window), windows.context,
                         *windows.stamps(), windows.actual.shape[1], sampling, sampling.batch_size)  # (W, S, P, 6)
    advice = ("forecast.calibrate: false forecasts with the raw bands; a series whose sampled paths cross zero is "
              "priced near zero next to its moves: check its prices")
    calibration, excluded = conformal.fit_windows(paths[..., CLOSE], windows.actual[..., CLOSE],
                                                  windows.context[:, -1, CLOSE], windows.names, sampling.decoding(),
                                                  "calibration of the bands", advice)
    failed = {"reason": f"every validation window has a sampled or realised close <= 0 ({len(windows)} windows)",
              "series": sorted(excluded), "advice": advice}
    check_seal(best)  # re-sealed after the write: an earlier verdict or calibration no longer holds
    info = {k: v for k, v in forecaster.read_predictor_info(best).items() if k not in (FAILED_KEY, "calibration")}
    write_json(best / forecaster.PREDICTOR_INFO_NAME, info | ({"calibration": calibration} if calibration else
                                                              {FAILED_KEY: failed}))
    seal(best)
    if calibration is not None:
        log.info("calibration of the bands fitted on %d validation windows -> %s", calibration["windows"],
                 best / forecaster.PREDICTOR_INFO_NAME)
    return calibration


def make_crps_val_metric(cfg: CsvFinetuneConfig, val_windows: HeldOutWindows, tokenizer: KronosTokenizer,
                         max_windows: int = 64) -> ValMetric:  # 64: ranks epochs, cheap next to an epoch
    """`training.select_by: crps`: `metric(predictor)` over a fixed, evenly spread subsample of `max_windows`
    validation windows, sampled with the (frozen) tokenizer the predictor trains with (`cfg`: data.lookback /
    predict / clip, forecast sampling): {"score": mean CRPS of the close in returns from the last context close,
    "crps", "mae" (of the sample median), "windows", "samples"}; the Validator forks the random streams around it."""
    if len(val_windows) == 0:
        raise DataError("the validation split has no window to score: lower data.lookback / data.predict or raise "
                        "data.val_ratio, or select checkpoints by loss (training.select_by: loss)")
    windows = val_windows.subset(spread_evenly(len(val_windows), max_windows))
    x_stamps, y_stamps = windows.stamps()  # (W, L, 5), (W, P, 5)
    f = cfg.forecast

    def metric(model: torch.nn.Module) -> dict:
        module = getattr(model, "module", model)  # DDP-wrapped or not
        device = next(module.parameters()).device
        was_training = module.training
        predictor = forecaster.KronosPredictor.from_models(module, tokenizer, device=str(device),
                                                           window=cfg.data.window)
        try:  # interruptible=False: the loop stops after its own checkpoint, not in here
            paths = sample_paths(predictor, windows.context, x_stamps, y_stamps, cfg.data.predict, f, f.batch_size,
                                 interruptible=False)  # (W, S, P, 6), seeded with forecast.seed
        finally:
            module.train(was_training)
        crps, mae = (float(v.mean()) for v in window_crps_mae(paths, windows))  # every window has P horizons
        return {"score": crps, "crps": crps, "mae": mae, "windows": len(windows), "samples": int(paths.shape[1])}

    return metric
