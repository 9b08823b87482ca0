"""Forecast every test day with the finetuned models, score the signals against the trade and backtest them in Qlib,
next to the baselines (the pretrained model before finetuning, momentum, reversal).

    python finetune/qlib_test.py --config configs/qlib_csi300.yaml [--device cuda:0]

Forecasts (finetune/qlib_forecast.py): one per member stock and trading day from the last trading day BEFORE
data.test_time_range (so the first test day trades) to its end, each from the `lookback` bars ending that day; with
forecast.seeds, once per seed. Labels (finetune/evaluation/qlib_labels.py): the return a position entered at the next
day's backtest.deal_price earns over h days, price(t+1+h) / price(t+1) - 1, computed by Qlib expressions on the market
calendar (NaN across a suspension), h = 1..data.predict. Scores (finetune/evaluation/signal_analysis.py, Qlib's
calc_ic / calc_long_short_return): IC, RankIC, ICIR, Newey-West t per horizon, each signal's headline at the horizon
it forecasts. Backtest: Qlib's TopkDropoutStrategy per signal (settings: finetune/config.py BacktestConfig and
docs/qlib_evaluation.md), with turnover and positions.

Writes to paths.backtest_result_path (all or nothing): report.json (strict JSON), summary.csv, signals.csv,
ic_decay.csv, ic_decay.png, backtest_daily.csv, cumulative_return.png.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from finetune.config import QlibConfig, check_model_folder, cli_parser, load
from finetune.dataset import check_processed, load_split, read_manifest, split_path
from finetune.evaluation.baselines import BaselineSettings, baseline_signals
from finetune.evaluation.qlib_labels import forward_labels
from finetune.evaluation.signal_analysis import ic_decay, plot_ic_decay
from finetune.qlib_data_preprocess import first_signal_day
from finetune.qlib_forecast import (
    Forecaster,
    forecast_frame,
    forecast_window_ends,
    kronos_forecaster,
    signal_horizon,
)
from finetune.qlib_io import check_qlib_folder, init_qlib, range_bounds
from finetune.qlib_report import (
    backtest_period,
    plot_cumulative,
    score_signal,
    seed_spread,
    summary_table,
)
from finetune.utils.checkpoint import load_pretrained
from finetune.utils.config_utils import config_to_dict
from finetune.utils.data.panel import SeriesPanel
from model import Kronos, KronosTokenizer
from model.fileio import write_json

log = logging.getLogger("finetune.qlib")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli_parser(__doc__)
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu, ... (default: cuda if available, else cpu)")
    return parser.parse_args(argv)


def check_inputs(cfg: QlibConfig) -> None:
    """Every settings and input problem of the backtest, raised as one ConfigError before any model is run."""
    problems = cfg.problems()
    check_processed(cfg, ("test",), problems)
    check_model_folder(cfg.paths.finetuned_tokenizer_path, "paths.finetuned_tokenizer_path", problems, hub_ok=False)
    check_model_folder(cfg.paths.finetuned_predictor_path, "paths.finetuned_predictor_path", problems, hub_ok=False)
    check_qlib_folder(cfg, problems)
    problems.raise_if_any()


def write_results(folder: str | Path, files: dict[str, Any]) -> Path:
    """Write {name: DataFrame | dict | callback(path)} into `folder`, all or nothing (temporary folder first);
    dicts are written as strict JSON (NaN -> null)."""
    folder = Path(folder).expanduser()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, content in files.items():
            target = tmp / name
            if isinstance(content, pd.DataFrame):
                content.to_csv(target, index=content.index.name is not None)
            elif isinstance(content, dict):
                write_json(target, content)
            else:
                content(target)
        folder.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def zero_shot_models(cfg: QlibConfig) -> tuple[Any, Any] | None:
    """(tokenizer, predictor) of model.pretrained_* when both are configured and loadable; None (with a logged line
    saying why) otherwise, e.g. a Hub id that cannot be fetched offline."""
    tok, pred = cfg.model.pretrained_tokenizer, cfg.model.pretrained_predictor
    if not tok or not pred:
        log.info("zero-shot baseline skipped: model.pretrained_tokenizer / pretrained_predictor not both configured")
        return None
    try:
        return (load_pretrained(KronosTokenizer, tok, "model.pretrained_tokenizer"),
                load_pretrained(Kronos, pred, "model.pretrained_predictor"))
    except Exception as e:  # noqa: BLE001  (an unreachable hub or a bad folder only drops this baseline)
        log.warning("zero-shot baseline skipped: cannot load %s / %s (%s)", tok, pred, str(e).splitlines()[0][:200])
        return None


def forecast_signals(cfg: QlibConfig, split: SeriesPanel, calendar_ns: np.ndarray, forecaster: Forecaster,
                     first_day: pd.Timestamp) -> pd.DataFrame:
    """Signals of every forecast day from `first_day` to the end of the test range: columns datetime, instrument,
    last, mean, max, min."""
    d, f = cfg.data, cfg.forecast
    _, end = range_bounds(d.test_time_range)
    ends = forecast_window_ends(split, pd.Timestamp(first_day).value, end.value, d.lookback)
    if len(ends) == 0:
        raise ValueError(f"data.test_time_range: no instrument has {d.lookback} bars before a day of the test range")
    return forecast_frame(split, ends, calendar_ns, forecaster, lookback=d.lookback, predict=d.predict, freq=d.freq,
                          batch=max(1, f.batch_size // f.sample_count))


def evaluate(cfg: QlibConfig, forecasters: dict[str, Forecaster], split: SeriesPanel, calendar_ns: np.ndarray,
             calendar: pd.DatetimeIndex) -> tuple[dict[str, Any], dict[str, Any]]:
    """Forecast with every named forecaster ("seed0", "seed1", ..., "zeroshot"), add the baselines, score and
    backtest everything over the same days. Qlib must be initialised. Returns (report dict, files to write)."""
    d, b = cfg.data, cfg.backtest
    start, end = range_bounds(d.test_time_range)
    first_day = first_signal_day(calendar, start)
    bt_start, bt_end = backtest_period(calendar, start, end)

    frames = {}
    for name, forecaster in forecasters.items():
        log.info("forecasting the test split (%s): %d series", name, split.n_series)
        forecast = forecast_signals(cfg, split, calendar_ns, forecaster, first_day)
        frames[name] = forecast.set_index(["datetime", "instrument"])
    index = next(iter(frames.values())).index  # member stocks x forecast days (the same for every forecaster)
    instruments = sorted(set(index.get_level_values("instrument")))
    labels = forward_labels(instruments, first_day, end, deal_price=b.deal_price, horizons=d.predict, freq=d.freq)
    labels = labels.reindex(index)

    signals: dict[str, pd.Series] = {}
    for name, frame in frames.items():
        for s in b.signals:
            signals[f"{s}" if name == "seed0" and len(frames) == 1 else f"{s}@{name}"] = frame[s]
    if b.baselines:
        base = baseline_signals(instruments, first_day, end, BaselineSettings(b.momentum_window, b.reversal_window),
                                freq=d.freq).reindex(index)  # only member stock-days, as the model's
        for col in base.columns:
            signals[col] = base[col]

    results, daily = {}, {}
    for name, pred in signals.items():
        kind = name.split("@")[0]
        horizon = signal_horizon(kind, d.predict)
        log.info("scoring and backtesting %s (label horizon %d)", name, horizon)
        results[name], daily[name] = score_signal(cfg, pred, labels, horizon, bt_start, bt_end)

    seeds = [n for n in frames if n.startswith("seed")]
    spread = {}
    if len(seeds) > 1:
        for s in b.signals:
            spread[s] = seed_spread([results[f"{s}@{n}"] for n in seeds])
    table = summary_table(results)
    merged = pd.concat({n: f.drop(columns=["bench"]) for n, f in daily.items()}, axis=1)
    merged.columns = [f"{n}_{c}" for n, c in merged.columns]
    merged = merged.assign(bench=next(iter(daily.values()))["bench"])
    merged.index.name = "datetime"
    decay = {n: ic_decay(r["analysis"]) for n, r in results.items()}
    decay_table = pd.concat(decay, names=["signal", "horizon"])
    signals_table = pd.DataFrame(signals).join(labels).reset_index()

    report = {
        "summary": table.to_dict(orient="index"),
        "signals": results,
        "seed_spread": spread,
        "forecast_days": [str(first_day.date()), str(pd.Timestamp(index.get_level_values(0).max()).date())],
        "backtest_period": [str(bt_start.date()), str(bt_end.date())],
        "benchmark": cfg.benchmark,
        "label": f"{b.deal_price}(t+1+h) / {b.deal_price}(t+1) - 1, h = 1..{d.predict}",
        "forecasts": len(index),
        "instruments": len(instruments),
    }
    files = {
        "summary.csv": table.rename_axis("signal"),
        "signals.csv": signals_table,
        "ic_decay.csv": decay_table.reset_index(),
        "ic_decay.png": lambda p: plot_ic_decay(
            {n: t for n, t in decay.items() if "@seed" not in n or "@seed0" in n}, p
        ),
        "backtest_daily.csv": merged,
        "cumulative_return.png": lambda p: plot_cumulative(daily, cfg.benchmark, p),
    }
    return report, files


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    cfg = load(args.config, args.set)
    check_inputs(cfg)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    d, f = cfg.data, cfg.forecast

    split = load_split(split_path(d.dataset_path, "test"))  # memory-mapped
    calendar_ns = np.asarray(read_manifest(d.dataset_path)["calendar_ns"], dtype=np.int64)
    init_qlib(cfg)
    from qlib.data import D

    calendar = pd.DatetimeIndex(D.calendar(freq=d.freq))
    tokenizer = load_pretrained(KronosTokenizer, cfg.paths.finetuned_tokenizer_path, "paths.finetuned_tokenizer_path")
    predictor = load_pretrained(Kronos, cfg.paths.finetuned_predictor_path, "paths.finetuned_predictor_path")

    def make(tok, pred, seed):
        return kronos_forecaster(tok, pred, device=device, max_context=d.max_context, clip=d.clip, predict=d.predict,
                                 temperature=f.temperature, top_k=f.top_k, top_p=f.top_p,
                                 sample_count=f.sample_count, seed=seed)

    forecasters = {f"seed{i}": make(tokenizer, predictor, seed) for i, seed in enumerate(f.seed_list())}
    zero = zero_shot_models(cfg)
    if zero is not None:
        forecasters["zeroshot"] = make(*zero, f.seed_list()[0])
    report, files = evaluate(cfg, forecasters, split, calendar_ns, calendar)
    report.update(device=device, seeds=f.seed_list(), config=config_to_dict(cfg))
    out = write_results(cfg.paths.backtest_result_path, {"report.json": report, **files})

    table = pd.DataFrame(report["summary"]).T
    table[["h", "days"]] = table[["h", "days"]].astype(int)
    print(f"\n--- signals {report['forecast_days'][0]}..{report['forecast_days'][1]}, backtest "
          f"{report['backtest_period'][0]}..{report['backtest_period'][1]} vs {cfg.benchmark} "
          f"(IC at the horizon h each signal forecasts, t_IC Newey-West; excess_ann, IR, max_dd with cost) ---")
    print(table.to_string(float_format=lambda v: f"{v:.4f}"))
    for s, sp in report["seed_spread"].items():
        print(f"{s}: over {sp['seeds']} seeds IC {sp['IC']['mean']:.4f} +- {sp['IC']['std']:.4f}, excess_ann "
              f"{sp['excess_return_with_cost_ann']['mean']:.4f} +- {sp['excess_return_with_cost_ann']['std']:.4f}")
    print(f"\nresults in {out}")
    return report


if __name__ == "__main__":
    import sys

    from finetune.cli import run_script  # clean errors, exit codes, --debug, --help-config, --print-config

    sys.exit(run_script("qlib-backtest", main))
