"""Forecast every test window with the finetuned models, score the signals (IC, RankIC) and backtest them in Qlib.

    python finetune/qlib_test.py --config configs/qlib_csi300.yaml [--device cuda:0]

For each instrument and trading day t of data.test_time_range with lookback bars up to t, the predictor
samples forecast.sample_count paths of predict bars (batched, cached generator); the mean path's closes
give four signals, each a predicted return against the last observed close c_t:
    last = close[t+P] / c_t - 1     mean = mean(close[t+1..t+P]) / c_t - 1
    max  = max(close[t+1..t+P]) / c_t - 1     min = min(...) / c_t - 1
(the original subtracted normalised values, which ranks stocks by their price volatility as much as by the forecast).
IC / RankIC: the daily cross-sectional Pearson / Spearman correlation of a signal with the realised return
close[t+h] / close[t] - 1 (h = backtest.ic_horizon), reported as mean, std and ICIR = mean / std.
Backtest: Qlib's TopkDropoutStrategy on each signal (the signal of day t trades on day t+1), against
backtest.benchmark, with the configured costs and price limits.

Writes to paths.backtest_result_path: signals.csv, ic_daily.csv, backtest_daily.csv, report.json and
cumulative_return.png (all or nothing).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from finetune.config import QlibConfig, check_model_folder, cli_parser, load
from finetune.dataset import check_processed, load_split, read_manifest, split_path
from finetune.qlib_io import (
    CLOSE,
    check_qlib_folder,
    init_qlib,
    range_bounds,
    stamps_from_ns,
    time_major,
)
from finetune.utils.checkpoint import load_pretrained
from finetune.utils.config_utils import config_to_dict
from finetune.utils.panel import SeriesPanel
from model import Kronos, KronosPredictor, KronosTokenizer

log = logging.getLogger("finetune.qlib")


# ----------------------------------------------------------------------------------------------------------------
# windows (pure)


def forecast_window_ends(split: SeriesPanel, start_ns: int, end_ns: int, lookback: int) -> np.ndarray:
    """Global row numbers t of every forecast: bar t inside [start, end] with `lookback` bars of its instrument
    ending at t. int64 (W,), ordered by instrument then time."""
    series = np.repeat(np.arange(split.n_series), split.lengths())  # (N,) instrument of each row
    position = np.arange(split.n_rows) - split.offsets[series]  # (N,) bar number within the instrument
    ok = (position >= lookback - 1) & (split.datetimes >= start_ns) & (split.datetimes <= end_ns)
    return np.flatnonzero(ok).astype(np.int64)


def context_rows(ends: np.ndarray, lookback: int) -> np.ndarray:
    """(W, lookback) row numbers of the contexts ending at `ends`."""
    return ends[:, None] - (lookback - 1) + np.arange(lookback)


def extend_calendar(calendar_ns: np.ndarray, extra: int, freq: str) -> np.ndarray:
    """The calendar plus `extra` dates after its end (business days for daily bars, else the last bar spacing):
    the forecast dates of the last windows when the data ends inside the forecast horizon."""
    last = pd.Timestamp(int(calendar_ns[-1]))
    if freq.lower() in ("day", "1d", "d"):
        more = pd.bdate_range(last + pd.Timedelta(1, "D"), periods=extra)
    else:
        step = int(calendar_ns[-1] - calendar_ns[-2]) if len(calendar_ns) > 1 else 60_000_000_000
        more = pd.DatetimeIndex([last + pd.Timedelta(step * (i + 1), "ns") for i in range(extra)])
    return np.r_[calendar_ns, more.as_unit("ns").asi8].astype(np.int64)


def forecast_dates(calendar_ns: np.ndarray, after_ns: np.ndarray, n: int, freq: str) -> np.ndarray:
    """(W, n) int64 ns: the `n` trading days after each of `after_ns` (W,)."""
    cal = extend_calendar(np.asarray(calendar_ns, dtype=np.int64), n, freq)
    first = np.searchsorted(cal, after_ns, side="right")  # (W,) first calendar day after each context
    return cal[first[:, None] + np.arange(n)]


def normalise_contexts(x: np.ndarray, clip: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (W, L, F) -> (clipped z-scores, mean (W, F), std (W, F)); population std + 1e-5, as in training."""
    mean, std = x.mean(axis=1), x.std(axis=1)
    xn = np.clip((x - mean[:, None]) / (std[:, None] + 1e-5), -clip, clip)
    return xn.astype(np.float32), mean, std


def signals_from_closes(pred_close: np.ndarray, last_close: np.ndarray) -> dict[str, np.ndarray]:
    """Predicted closes (W, P) and the last observed close (W,) -> predicted returns per signal, each (W,)."""
    base = last_close[:, None]
    return {
        "last": pred_close[:, -1] / last_close - 1.0,
        "mean": pred_close.mean(axis=1) / last_close - 1.0,
        "max": (pred_close / base).max(axis=1) - 1.0,
        "min": (pred_close / base).min(axis=1) - 1.0,
    }


def realised_returns(split: SeriesPanel, ends: np.ndarray, horizon: int) -> np.ndarray:
    """close[t + horizon] / close[t] - 1 within each instrument (W,); NaN where the data ends first."""
    series = np.searchsorted(split.offsets, ends, side="right") - 1
    target = ends + horizon
    ok = target < split.offsets[series + 1]
    out = np.full(len(ends), np.nan)
    close = split.features[CLOSE]  # (N,)
    out[ok] = close[target[ok]].astype(np.float64) / close[ends[ok]] - 1.0
    return out


# ----------------------------------------------------------------------------------------------------------------
# IC (pure)


def _grouped_corr(key: np.ndarray, x: np.ndarray, y: np.ndarray) -> pd.Series:
    """Pearson correlation of x and y within each key (vectorised group moments); NaN for < 2 points or a
    constant side."""
    df = pd.DataFrame({"k": key, "x": x, "y": y, "xy": x * y, "xx": x * x, "yy": y * y})
    g = df.groupby("k")
    m, n = g.mean(), g.size()
    cov, vx, vy = m.xy - m.x * m.y, m.xx - m.x**2, m.yy - m.y**2
    # a side whose variance is rounding noise relative to its second moment is constant: no correlation
    ok = (n >= 2) & (vx > 1e-10 * m.xx) & (vy > 1e-10 * m.yy)
    return (cov / np.sqrt(vx.clip(lower=0) * vy.clip(lower=0))).where(ok)


def daily_ic(frame: pd.DataFrame, signals: list[str], label: str = "label") -> pd.DataFrame:
    """Per day: `<signal>_ic` (Pearson) and `<signal>_rank_ic` (Spearman) across instruments; rows without a
    label are left out. `frame` has columns datetime, the signals and `label`."""
    f = frame[np.isfinite(frame[label].to_numpy(dtype=np.float64))]
    out = {}
    for s in signals:
        x, y = f[s].to_numpy(np.float64), f[label].to_numpy(np.float64)
        out[f"{s}_ic"] = _grouped_corr(f["datetime"].to_numpy(), x, y)
        rx = f.groupby("datetime")[s].rank().to_numpy(np.float64)
        ry = f.groupby("datetime")[label].rank().to_numpy(np.float64)
        out[f"{s}_rank_ic"] = _grouped_corr(f["datetime"].to_numpy(), rx, ry)
    daily = pd.DataFrame(out)
    daily.index.name = "datetime"
    return daily


def summarize_ic(daily: pd.DataFrame, signals: list[str]) -> dict[str, dict[str, float]]:
    """{signal: {IC, IC_std, ICIR, RankIC, RankIC_std, RankICIR, days}} from `daily_ic`."""
    def stats(col: pd.Series) -> tuple[float, float, float]:
        col = col.dropna()
        mean, std = float(col.mean()) if len(col) else math.nan, float(col.std()) if len(col) > 1 else math.nan
        return mean, std, mean / std if std and std > 0 else math.nan

    out = {}
    for s in signals:
        ic, ic_std, icir = stats(daily[f"{s}_ic"])
        ric, ric_std, ricir = stats(daily[f"{s}_rank_ic"])
        out[s] = {"IC": ic, "IC_std": ic_std, "ICIR": icir, "RankIC": ric, "RankIC_std": ric_std, "RankICIR": ricir,
                  "days": int(daily[f"{s}_ic"].notna().sum())}
    return out


def backtest_period(calendar: pd.DatetimeIndex, start: pd.Timestamp, end: pd.Timestamp) -> tuple[pd.Timestamp, pd.Timestamp]:
    """Trading days [first >= start, last <= end], and before the calendar's last day: Qlib's backtest needs
    the day after its last step (IndexError otherwise)."""
    days = calendar[(calendar >= start) & (calendar <= end)]
    days = days[days < calendar[-1]]
    if len(days) < 2:
        raise ValueError(f"data.test_time_range: fewer than 2 trading days to backtest between {start.date()} and {end.date()}")
    return days[0], days[-1]


# ----------------------------------------------------------------------------------------------------------------
# forecasting


def forecast_signals(cfg: QlibConfig, split: SeriesPanel, calendar_ns: np.ndarray, tokenizer: KronosTokenizer,
                     predictor: Kronos, device: str) -> pd.DataFrame:
    """One row per test window: datetime, instrument, one column per signal, and `label` (realised return)."""
    d, f = cfg.data, cfg.forecast
    start, end = range_bounds(d.test_time_range)
    ends = forecast_window_ends(split, start.value, end.value, d.lookback)
    if len(ends) == 0:
        raise ValueError(f"data.test_time_range: no instrument has {d.lookback} bars before a day of the test range")
    future = forecast_dates(calendar_ns, split.datetimes[ends], d.predict, d.freq)  # (W, P) ns

    kp = KronosPredictor(predictor, tokenizer, device=device, max_context=d.max_context, clip=d.clip)
    torch.manual_seed(f.seed)
    per_batch = max(1, f.batch_size // f.sample_count)  # windows per forward pass (each repeated sample_count x)
    closes = np.empty((len(ends), d.predict), dtype=np.float64)
    for lo in tqdm(range(0, len(ends), per_batch), desc="forecast", unit="batch", dynamic_ncols=True):
        hi = min(lo + per_batch, len(ends))
        rows = context_rows(ends[lo:hi], d.lookback)  # (B, L)
        xn, mean, std = normalise_contexts(time_major(split, rows), d.clip)  # (B, L, 6), (B, 6), (B, 6)
        y_stamp = stamps_from_ns(future[lo:hi].ravel()).reshape(hi - lo, d.predict, 5)  # (B, P, 5)
        paths = kp.generate(xn, split.stamps[rows], y_stamp, d.predict, T=f.temperature, top_k=f.top_k,
                            top_p=f.top_p, sample_count=f.sample_count)  # (B, S, P, 6), normalised
        # average the sample paths, then undo the context normalisation of close
        closes[lo:hi] = paths[..., CLOSE].mean(axis=1) * (std[:, CLOSE, None] + 1e-5) + mean[:, CLOSE, None]

    last_close = split.features[CLOSE, ends].astype(np.float64)
    series = np.searchsorted(split.offsets, ends, side="right") - 1
    frame = pd.DataFrame({
        "datetime": pd.DatetimeIndex(split.datetimes[ends].astype("datetime64[ns]")),
        "instrument": np.asarray(split.names)[series].astype(str),
        **signals_from_closes(closes, last_close),
        "label": realised_returns(split, ends, cfg.backtest.ic_horizon),
    })
    return frame


# ----------------------------------------------------------------------------------------------------------------
# Qlib backtest


def run_backtest(cfg: QlibConfig, signal: pd.Series, start: pd.Timestamp, end: pd.Timestamp) -> pd.DataFrame:
    """Qlib TopkDropoutStrategy on `signal` (index datetime, instrument); daily report with columns return, cost,
    bench, turnover, account."""
    from qlib.backtest import backtest, executor
    from qlib.contrib.strategy import TopkDropoutStrategy

    b = cfg.backtest
    strategy = TopkDropoutStrategy(topk=b.topk, n_drop=b.n_drop, hold_thresh=b.hold_thresh, signal=signal)
    ex = executor.SimulatorExecutor(time_per_step=cfg.data.freq, generate_portfolio_metrics=True, verbose=False)
    exchange = {"freq": cfg.data.freq, "limit_threshold": b.limit_threshold, "deal_price": b.deal_price,
                "open_cost": b.open_cost, "close_cost": b.close_cost, "min_cost": b.min_cost}
    with warnings.catch_warnings():
        # Qlib averages an empty order list on days the strategy only holds ("Mean of empty slice"): harmless.
        warnings.simplefilter("ignore", RuntimeWarning)
        metrics, _ = backtest(start_time=start, end_time=end, strategy=strategy, executor=ex, account=b.account,
                              benchmark=cfg.benchmark, exchange_kwargs=exchange)
    report, _ = next(iter(metrics.values()))
    return report


def risk(returns: pd.Series, freq: str) -> dict[str, float]:
    """Qlib's risk analysis (mean, std, annualized_return, information_ratio, max_drawdown) as a dict."""
    from qlib.contrib.evaluate import risk_analysis

    table = risk_analysis(returns, freq=freq)
    return {k: float(v) for k, v in table["risk"].items()}


def plot_cumulative(daily: pd.DataFrame, signals: list[str], benchmark: str, path: Path) -> None:
    """Cumulative return with cost per signal vs the benchmark, and cumulative excess return with cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for s in signals:
        net = daily[f"{s}_return"] - daily[f"{s}_cost"]
        top.plot(daily.index, net.cumsum(), label=s)
        bottom.plot(daily.index, (net - daily["bench"]).cumsum(), label=s)
    top.plot(daily.index, daily["bench"].cumsum(), "k--", label=benchmark)
    top.set(title="Cumulative return with cost", ylabel="cumulative return")
    bottom.set(title="Cumulative excess return with cost", ylabel="cumulative excess return", xlabel="date")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# entry point


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
    """Write {name: DataFrame | dict | matplotlib callback} into `folder`, all or nothing (temporary folder first)."""
    folder = Path(folder).expanduser()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, content in files.items():
            target = tmp / name
            if isinstance(content, pd.DataFrame):
                content.to_csv(target, index=content.index.name is not None)
            elif isinstance(content, dict):
                target.write_text(json.dumps(content, indent=2, default=str) + "\n")
            else:
                content(target)
        folder.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    cfg = load(args.config, args.set)
    check_inputs(cfg)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    d, b = cfg.data, cfg.backtest

    # --- forecast every test window
    split = load_split(split_path(d.dataset_path, "test"))
    manifest = read_manifest(d.dataset_path)
    tokenizer = load_pretrained(KronosTokenizer, cfg.paths.finetuned_tokenizer_path, "paths.finetuned_tokenizer_path")
    predictor = load_pretrained(Kronos, cfg.paths.finetuned_predictor_path, "paths.finetuned_predictor_path")
    log.info("forecasting the test split on %s: %d instruments", device, split.n_series)
    frame = forecast_signals(cfg, split, np.asarray(manifest["test_calendar_ns"], dtype=np.int64), tokenizer, predictor, device)
    log.info("%d forecasts, %s .. %s", len(frame), frame.datetime.min().date(), frame.datetime.max().date())

    # --- IC
    daily_ic_table = daily_ic(frame, b.signals)
    ic = summarize_ic(daily_ic_table, b.signals)
    print("\n--- IC (daily cross-section, realised return over %d bar(s)) ---" % b.ic_horizon)
    print(pd.DataFrame(ic).T.round(4).to_string())

    # --- backtest
    init_qlib(cfg)
    from qlib.data import D

    start, end = range_bounds(d.test_time_range)
    bt_start, bt_end = backtest_period(pd.DatetimeIndex(D.calendar(freq=d.freq)), start, end)
    if bt_end < frame.datetime.max():
        log.info("the backtest ends on %s: Qlib needs one trading day after the last step", bt_end.date())
    results, daily = {}, None
    for s in b.signals:
        signal = frame.set_index(["datetime", "instrument"])[s].sort_index()
        log.info("backtesting signal %r: %s .. %s, top %d, drop %d", s, bt_start.date(), bt_end.date(), b.topk, b.n_drop)
        report = run_backtest(cfg, signal, bt_start, bt_end)
        excess = report["return"] - report["bench"]
        results[s] = {
            "benchmark": risk(report["bench"], d.freq),
            "excess_return_without_cost": risk(excess, d.freq),
            "excess_return_with_cost": risk(excess - report["cost"], d.freq),
        }
        part = report[["return", "cost", "turnover"]].add_prefix(f"{s}_")
        daily = part.assign(bench=report["bench"]) if daily is None else daily.join(part)
        print(f"\n--- Backtest: signal {s} ---")
        print(pd.DataFrame(results[s]).round(4).to_string())
    daily.index.name = "datetime"

    summary = {
        "ic": ic,
        "backtest": results,
        "backtest_period": [str(bt_start.date()), str(bt_end.date())],
        "benchmark": cfg.benchmark,
        "forecasts": int(len(frame)),
        "instruments": int(frame.instrument.nunique()),
        "device": device,
        "config": config_to_dict(cfg),
    }
    out = write_results(cfg.paths.backtest_result_path, {
        "signals.csv": frame,
        "ic_daily.csv": daily_ic_table,
        "backtest_daily.csv": daily,
        "report.json": summary,
        "cumulative_return.png": lambda p: plot_cumulative(daily, b.signals, cfg.benchmark, p),
    })
    print(f"\nresults in {out}")
    return summary


if __name__ == "__main__":
    import sys

    from finetune.cli import run_script  # clean errors, exit codes, --debug, --help-config, --print-config

    sys.exit(run_script("qlib-backtest", main))
