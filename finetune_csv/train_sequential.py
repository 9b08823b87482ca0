"""Finetune Kronos on your own CSV candles: the tokenizer first, then the predictor on the finetuned tokenizer's tokens.

    python finetune_csv/train_sequential.py --config configs/csv_demo.yaml [--set training.epochs=3 ...]
    DIST_BACKEND=nccl torchrun --standalone --nproc_per_node=8 finetune_csv/train_sequential.py --config ...

The same command runs on one GPU/CPU or, under torchrun, with DistributedDataParallel (DIST_BACKEND: nccl on
GPUs, gloo on CPU). Settings are checked before anything is written; the data is parsed and checked once into the
prepared store (data.store_dir, default <paths.base_dir>/data_store: rank 0 prepares or reuses it, the other ranks
wait, every rank memory-maps it; a failed preparation leaves nothing behind). Outputs under paths.base_dir:
tokenizer/ and basemodel/, each with best_model/ (published format), checkpoints/last.pt, metrics.jsonl,
loss_curve.png and run_info.json (see finetune/utils/training_utils.py).

`run_finetune(cfg, ...)` is the whole run as a function: this script's `main` and the Python API
(`finetune_csv.finetune`, finetune_csv/api.py) both call it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Mapping

import pandas as pd

import finetune_csv.config as csv_config
from finetune.utils.cli_args import add_config_args, add_run_flags, parse_config_args, run_overrides
from finetune.utils.config_utils import config_to_dict
from finetune.utils.distributed import DistInfo, barrier, distributed_context, seeded_init
from finetune.utils.errors import setup_logging
from finetune.utils.factory import build_predictor, build_tokenizer
from finetune.utils.safety import stage_status
from finetune.utils.training_utils import TrainResult, train_predictor, train_tokenizer
from finetune.utils.windows import PanelSegments
from finetune_csv.config import CsvFinetuneConfig, predictor_tokenizer_source
from finetune_csv.forecast import calibrate_best_model, held_out_windows, make_crps_val_metric
from finetune_csv.prepare import PreparedData, data_summary_from_store, prepare_data
from finetune_csv.sources import list_sources
from finetune_csv.splits import build_dataset
from model import KronosTokenizer

log = logging.getLogger("finetune_csv")
STAGES = ("tokenizer", "predictor")


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


def plan_stages(cfg: CsvFinetuneConfig, skip_tokenizer: bool, skip_predictor: bool,
                skip_existing: bool) -> dict[str, str | None]:
    """For each stage, None if it trains, else why it is skipped (flags, 0 epochs, --skip-existing)."""
    plan: dict[str, str | None] = {}
    for stage, skipped, folder in (("tokenizer", skip_tokenizer, cfg.tokenizer_dir),
                                   ("predictor", skip_predictor, cfg.predictor_dir)):
        if skipped:
            plan[stage] = f"--skip-{'tokenizer' if stage == 'tokenizer' else 'basemodel'}"
        elif cfg.stage_training(stage).epochs == 0:
            plan[stage] = f"{stage}_training.epochs is 0"
        elif stage == "tokenizer" and cfg.training.finetune_mode != "full":  # lora / freeze: predictor only
            plan[stage] = f"training.finetune_mode is {cfg.training.finetune_mode} (the tokenizer stays frozen)"
        elif skip_existing and stage_status(folder) == "finished":
            plan[stage] = f"--skip-existing and {folder} holds a finished run"
        else:
            plan[stage] = None
    return plan


def stage_resume(cfg: CsvFinetuneConfig, plan: dict[str, str | None]) -> dict[str, str]:
    """Each stage's training.resume. --resume (required) insists on resuming the RUN: when some stage that trains
    has a run in its folder, a stage with an empty folder starts fresh (e.g. the predictor after a kill in the
    tokenizer stage) instead of failing; with nothing anywhere to resume, it stays an error."""
    status = {stage: stage_status(getattr(cfg, f"{stage}_dir")) for stage in STAGES if plan[stage] is None}
    resume = {stage: cfg.stage_training(stage).resume for stage in STAGES}
    if any(s != "empty" for s in status.values()):
        for stage, s in status.items():
            if s == "empty" and resume[stage].strip().lower() == "required":
                resume[stage] = "auto"
    return resume


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
    """The CSV finetuning run for a validated config: data store, tokenizer stage, predictor stage.

    frames: {name: DataFrame} (finetune_csv/api.py), read instead of the files of data.path.
    splits: explicit {"train", "val"} index ranges of the store's panel (a walk-forward fold) instead of the ratios.
    Returns (results of the stages that trained, {stage: None | why skipped}, the data summary of run_info.json).
    """
    plan = plan_stages(cfg, skip_tokenizer, skip_predictor, skip_existing)
    resume = stage_resume(cfg, plan)
    run_config = config_to_dict(cfg)
    results: list[TrainResult] = []
    with distributed_context(cfg.training.dist_timeout_s) as dist:
        list_sources(cfg.data.path if frames is None else frames)  # a wrong data path, before any model loads
        # Models next (cheap to check, and a mistake then leaves no data store behind). A from-scratch model starts
        # from the same weights on every run (seeded_init); the engine seeds the training streams itself.
        m = cfg.model
        if plan["tokenizer"] is None:
            with seeded_init(cfg.training.seed):
                tokenizer = build_tokenizer(m.pretrained_tokenizer, m.tokenizer_arch, "model")
            if plan["predictor"] is None:  # check the pair up front, not after an hour of tokenizer training
                build_predictor(m.pretrained_predictor, m.predictor_arch, tokenizer, "model")
        elif plan["predictor"] is None:  # the tokenizer it will use, and a bad pretrained_predictor, before the store
            tokenizer = KronosTokenizer.from_pretrained(predictor_tokenizer_source(cfg))
            build_predictor(m.pretrained_predictor, m.predictor_arch, tokenizer, "model")
        # Data: rank 0 parses and checks every file into the store (or reuses it), the others wait; every rank
        # maps it read-only (one page-cache copy per machine); the splits are index ranges, nothing is copied.
        data = prepare_data(cfg.data, cfg.store_dir, dist=dist, barrier=barrier, frames=frames,
                            with_splits=splits is None)
        if splits is not None:
            data = dataclasses.replace(data, splits={k: dataclasses.replace(v, panel=data.panel)
                                                     for k, v in splits.items()})
        train_set, val_set = build_dataset(data.splits["train"], cfg.data), build_dataset(data.splits["val"], cfg.data)
        data_info = data_summary_from_store(data, cfg.data)
        if dist.is_main:
            log.info("%s", describe(cfg, data_info, plan, dist, data))
        if plan["tokenizer"] is None:
            # The tokenizer has no forecast to score: it is always selected by its validation loss.
            tok_training = dataclasses.replace(cfg.stage_training("tokenizer"), select_by="loss",
                                               resume=resume["tokenizer"])
            results.append(train_tokenizer(tokenizer, train_set, val_set, tok_training,
                                           cfg.tokenizer_dir, dist, run_config=run_config, data_info=data_info,
                                           output_key="paths.base_dir"))
        if plan["predictor"] is None:
            # The best tokenizer epoch on disk (not the last one in memory): what the predictor will forecast with.
            tokenizer = KronosTokenizer.from_pretrained(predictor_tokenizer_source(cfg))
            with seeded_init(cfg.training.seed):
                predictor = build_predictor(m.pretrained_predictor, m.predictor_arch, tokenizer, "model")
            pred_training = dataclasses.replace(cfg.stage_training("predictor"), resume=resume["predictor"])
            val_metric = None  # select_by crps: sampled forecasts of the validation split's non-overlapping windows
            if pred_training.select_by == "crps":
                val_windows = held_out_windows(data.splits["val"], cfg.data.lookback, cfg.data.predict)
                val_metric = make_crps_val_metric(cfg, val_windows, tokenizer)
            # What forecasting needs beside the weights (kronos_predictor.json): the window, tokenizer and clip.
            forecast_info = {"max_context": cfg.data.lookback + cfg.data.predict, "lookback": cfg.data.lookback,
                             "tokenizer": predictor_tokenizer_source(cfg), "clip": cfg.data.clip}
            results.append(train_predictor(predictor, tokenizer, train_set, val_set, pred_training, cfg.predictor_dir,
                                           dist, run_config=run_config, data_info=data_info, val_metric=val_metric,
                                           forecast_info=forecast_info, output_key="paths.base_dir"))
            if dist.is_main:  # conformal bands fitted on the validation windows (forecast.calibrate)
                calibrate_best_model(cfg, data)
        if dist.is_main:
            log.info("%s", summarize(results, plan))
    return results, plan, data_info


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


def summarize(results: list[TrainResult], plan: dict[str, str | None]) -> str:
    lines = ["done."]
    for r in results:
        lines.append(f"  {r.stage}: best val loss {r.best_val_loss:.4f} (epoch {r.best_epoch}), "
                     f"{r.global_step} steps -> {r.best_model_dir}")
    lines += [f"  {stage}: skipped ({why})" for stage, why in plan.items() if why is not None]
    return "\n".join(lines)


if __name__ == "__main__":
    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
