"""Finetune Kronos on your own CSV candles: the tokenizer first, then the predictor on the finetuned tokenizer's tokens.

    python finetune_csv/train_sequential.py --config configs/csv_demo.yaml [--set training.epochs=3 ...]
    DIST_BACKEND=nccl torchrun --standalone --nproc_per_node=8 finetune_csv/train_sequential.py --config ...

The same command runs on one GPU/CPU or, under torchrun, with DistributedDataParallel (DIST_BACKEND: nccl on
GPUs, gloo on CPU). Settings are checked before anything is written; the data is parsed and checked once into the
prepared store (data.store_dir, default <paths.base_dir>/data_store: rank 0 prepares or reuses it, the other ranks
wait, every rank memory-maps it; a failed preparation leaves nothing behind). Outputs under paths.base_dir:
tokenizer/ and basemodel/, each with best_model/ (published format), checkpoints/last.pt, metrics.jsonl,
loss_curve.png and run_info.json (see finetune/utils/training_utils.py).

`run_finetune(cfg, ...)` is the whole run as a function (this script's `main`, the Python API in
finetune_csv/api.py and the walk-forward call it): the CSV data side (`CsvPipeline`) handed to the engine's stage
runner (finetune/utils/stages.py), which also calibrates the bands and honours SIGTERM between the stages."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import finetune_csv.config as csv_config
from finetune.evaluation.forecast_scores import crps_ensemble
from finetune.utils.cli_args import add_config_args, add_run_flags, parse_config_args, run_overrides
from finetune.utils.config_utils import STAGES
from finetune.utils.distributed import DistInfo, barrier
from finetune.utils.errors import setup_logging
from finetune.utils.ledger import plan_stages, stage_resume, stage_status
from finetune.utils.stages import run_stages
from finetune.utils.training_utils import TrainResult
from finetune.utils.validate import ValMetric
from finetune.utils.windows import HeldOutWindows, PanelSegments, held_out_windows, sample_paths, spread_evenly
from finetune_csv.config import CsvFinetuneConfig, best_dir
from finetune_csv.prepare import PreparedData, data_summary_from_store, prepare_data
from finetune_csv.sources import list_sources
from finetune_csv.splits import build_dataset
from model import KronosPredictor, KronosTokenizer
from model.errors import ConfigError, DataError
from model.features import CLOSE

log = logging.getLogger("finetune_csv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_flags(add_config_args(parser, CsvFinetuneConfig, csv_config.load))
    parser.add_argument("--skip-tokenizer", action="store_true",
                        help="do not train the tokenizer (the predictor uses the finetuned or pretrained one)")
    parser.add_argument("--skip-basemodel", "--skip-predictor", dest="skip_predictor", action="store_true",
                        help="do not train the predictor (basemodel)")
    parser.add_argument("--skip-existing", action="store_true",
                        help="skip a stage that FINISHED before (an interrupted stage is resumed, not skipped; "
                             "finished stages are also skipped by default, unless --overwrite)")
    return parse_config_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()  # rank 0 reports; under torchrun the other ranks only warn
    cfg = csv_config.load(args.config, list(args.set) + run_overrides(args))
    run_finetune(cfg, skip_tokenizer=args.skip_tokenizer, skip_predictor=args.skip_predictor,
                 skip_existing=args.skip_existing)
    return 0


def run_finetune(cfg: CsvFinetuneConfig, *, skip_tokenizer: bool = False, skip_predictor: bool = False,
                 skip_existing: bool = False, frames: Mapping[str, pd.DataFrame] | None = None,
                 splits: dict[str, PanelSegments] | None = None
                 ) -> tuple[list[TrainResult], dict[str, str | None], dict]:
    """The CSV finetuning run for a validated config: data store, tokenizer stage, predictor stage, calibration.

    frames: {name: DataFrame} (finetune_csv/api.py), read instead of the files of data.path.
    splits: explicit {"train", "val"} index ranges of the store's panel (a walk-forward fold) instead of the ratios.
    Returns (results of the stages that trained, {stage: None | why skipped}, the data summary of run_info.json)."""
    pipe = CsvPipeline(cfg, frames, splits)
    skip = {"tokenizer": "--skip-tokenizer"} if skip_tokenizer else {}
    if skip_predictor:
        skip["predictor"] = "--skip-basemodel"
    pipe.plan = plan_stages(pipe, STAGES, skip, skip_existing)
    list_sources(cfg.data.path if frames is None else frames)  # a wrong data path, before any model loads
    results, data_info = run_stages(pipe, pipe.plan, stage_resume(pipe, pipe.plan), rebuild_changed=skip_existing)
    return results, pipe.plan, data_info


def make_crps_val_metric(cfg: CsvFinetuneConfig, val_windows: HeldOutWindows, tokenizer: KronosTokenizer,
                         max_windows: int = 64) -> ValMetric:  # 64: ranks epochs, cheap next to an epoch
    """`training.select_by: crps`: `metric(model, stage)` over a fixed, evenly spread subsample of `max_windows`
    validation windows, sampled with the (frozen) tokenizer the predictor trains with (`cfg`: data.lookback /
    predict / clip, forecast sampling). For the predictor stage it returns {"score": mean CRPS of the close in
    returns from the last context close, "crps", "mae" (of the sample median), "windows", "samples"}; for the
    tokenizer stage (no forecast to score) None."""
    if len(val_windows) == 0:
        raise DataError("the validation split has no window to score: lower data.lookback / data.predict or raise "
                        "data.val_ratio, or select checkpoints by loss (training.select_by: loss)")
    windows = val_windows.subset(spread_evenly(len(val_windows), max_windows))
    x_stamps, y_stamps = windows.stamps()  # (W, L, 5), (W, P, 5)
    last = windows.context[:, -1, CLOSE]  # (W,)
    obs = windows.actual[..., CLOSE] / last[:, None] - 1.0  # (W, P)
    f = cfg.forecast

    def metric(model: torch.nn.Module, stage: object) -> dict | None:
        if getattr(stage, "name", stage) != "predictor":
            return None
        module = getattr(model, "module", model)  # DDP-wrapped or not
        device = next(module.parameters()).device
        was_training = module.training
        predictor = KronosPredictor.from_models(module, tokenizer, device=str(device), clip=cfg.data.clip,
                                                max_context=cfg.data.lookback + cfg.data.predict)
        try:  # interruptible=False: the loop stops after its own checkpoint, not in here
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                paths = sample_paths(predictor, windows.context, x_stamps, y_stamps, cfg.data.predict, f,
                                     f.batch_size, interruptible=False)  # (W, S, P, 6), seeded with forecast.seed
        finally:
            module.train(was_training)
        ens = np.moveaxis(paths[..., CLOSE] / last[:, None, None] - 1.0, 1, -1)  # (W, P, S)
        crps = float(crps_ensemble(obs, ens).mean())
        mae = float(np.abs(np.median(ens, axis=-1) - obs).mean())
        return {"score": crps, "crps": crps, "mae": mae, "windows": len(windows), "samples": int(ens.shape[-1])}

    return metric


class CsvPipeline:
    """The CSV pipeline's side of the stage runner (finetune/utils/stages.py): its data store, splits and
    windows, the tokenizer its predictor trains with, the CRPS metric and the calibration windows."""

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
        d = self.cfg.data
        return make_crps_val_metric(self.cfg, held_out_windows(self.data.splits["val"], d.lookback, d.predict),
                                    tokenizer)

    def calibration_windows(self) -> HeldOutWindows | None:
        """forecast.calibrate: conformal bands fitted on the validation windows."""
        d, f = self.cfg.data, self.cfg.forecast
        if not f.calibrate:
            return None
        return held_out_windows(self.data.splits["val"], d.lookback, d.predict, f.window_stride)


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
    for stage in STAGES:
        lines.append(f"  {stage}: " + ("train" if plan[stage] is None else f"skipped ({plan[stage]})"))
    lines.append(f"  {dist.world_size} process(es) on {dist.device}; outputs in {cfg.base_dir}")
    return "\n".join(lines)


if __name__ == "__main__":
    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
