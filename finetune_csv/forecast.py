"""Forecast the held-out test split with the finetuned models, score it and plot it (the demo's last step).

    python finetune_csv/forecast.py --config configs/csv_demo.yaml [--set forecast.top_k=1]

Windows are taken from each series' test split (data.test_ratio > 0): `forecast.max_windows` per series, evenly
spaced, whose forecast horizons do not overlap. Each gets `data.lookback` candles of context (which may reach
back into the validation rows, as in training) and is forecast `data.predict` candles ahead with
model.KronosPredictor.generate (key/value-cache generation); the candles stay numpy arrays end to end. Written to `<base_dir>/forecast/`: metrics.json,
forecast.csv (forecast and actual candles per window) and forecast_vs_actual.png; the metrics are also printed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from finetune.utils.checkpoint import write_json_atomic
from finetune.utils.config_utils import add_config_args
from finetune_csv import config as csv_config
from finetune_csv.config import CsvFinetuneConfig
from finetune_csv.data import Segment, load_series, split_series, window_starts
from finetune_csv.forecast_metrics import (
    candle_violations,
    close_mae,
    direction_accuracy,
    persistence_close,
)
from finetune_csv.model_dirs import best_dir, predictor_tokenizer_source
from model import Kronos, KronosPredictor, KronosTokenizer
from model.features import FEATURE_COLS, calc_time_stamps, normalize

log = logging.getLogger("finetune_csv.forecast")
CLOSE = FEATURE_COLS.index("close")


@dataclass
class HeldOutWindows:
    """N test windows: context candles and the actual candles that followed."""

    names: list[str]
    """(N,) series of each window."""
    context: np.ndarray
    """(N, lookback, 6) float64 context candles (columns FEATURE_COLS)."""
    x_timestamps: list[pd.DatetimeIndex]
    """N context time indexes."""
    y_timestamps: list[pd.DatetimeIndex]
    """N forecast time indexes (`predict` each)."""
    actual: np.ndarray
    """(N, predict, 6) float64 the candles that really followed."""

    def stamps(self) -> tuple[np.ndarray, np.ndarray]:
        """Calendar stamps of the contexts (N, lookback, 5) and of the forecast bars (N, predict, 5), int64."""
        as_array = lambda ts: calc_time_stamps(ts).to_numpy(np.int64)  # (T, 5)
        return (np.stack([as_array(ts) for ts in self.x_timestamps]),
                np.stack([as_array(ts) for ts in self.y_timestamps]))


def spread_evenly(n_available: int, n_wanted: int) -> np.ndarray:
    """Indices of min(n_wanted, n_available) items spread evenly over range(n_available), first and last included."""
    if n_available < 1:
        return np.zeros(0, dtype=np.int64)
    k = min(n_wanted, n_available)
    return np.unique(np.round(np.linspace(0, n_available - 1, k)).astype(np.int64))


def held_out_windows(segments: list[Segment], lookback: int, predict: int, max_windows: int) -> HeldOutWindows:
    """Up to `max_windows` windows per test segment, horizons `predict` rows apart (never overlapping)."""
    names, context, x_ts, y_ts, actual = [], [], [], [], []
    for seg in segments:
        starts = window_starts(seg, lookback + predict, stride=predict)
        for s in starts[spread_evenly(len(starts), max_windows)]:
            values, stamps = seg.values[s: s + lookback + predict], seg.timestamps[s: s + lookback + predict]
            names.append(seg.series.name)
            context.append(values[:lookback])
            x_ts.append(stamps[:lookback])
            y_ts.append(stamps[lookback:])
            actual.append(values[lookback:])
    n_features = len(FEATURE_COLS)
    return HeldOutWindows(names, np.asarray(context, dtype=np.float64).reshape(-1, lookback, n_features), x_ts, y_ts,
                          np.asarray(actual, dtype=np.float64).reshape(-1, predict, n_features))


def score(forecast: np.ndarray, windows: HeldOutWindows) -> dict:
    """Metrics of forecast candles (N, H, 6) against the actual ones; see finetune_csv.forecast_metrics."""
    last_close = windows.context[:, -1, CLOSE]  # (N,)
    pred_close, true_close = forecast[..., CLOSE], windows.actual[..., CLOSE]
    o, h, l, c, v = (forecast[..., FEATURE_COLS.index(f)] for f in ("open", "high", "low", "close", "volume"))
    return {
        "windows": int(len(forecast)),
        "horizon": int(forecast.shape[1]),
        "series": sorted(set(windows.names)),
        "close_mae": close_mae(pred_close, true_close),
        "close_mae_persistence": close_mae(persistence_close(last_close, forecast.shape[1]), true_close),
        "direction_accuracy": direction_accuracy(pred_close, true_close, last_close),
        "violations": candle_violations(o, h, l, c, v),
    }


def format_report(metrics: dict) -> str:
    """The metrics as the few lines the demo prints."""
    v = metrics["violations"]
    return "\n".join([
        f"held-out forecast: {metrics['windows']} windows x {metrics['horizon']} candles "
        f"from {len(metrics['series'])} series",
        f"  close MAE                       {metrics['close_mae']:.4f}"
        f"   (last-close persistence: {metrics['close_mae_persistence']:.4f})",
        f"  direction accuracy              {100 * metrics['direction_accuracy']:.1f} %   (close moves, step by step)",
        f"  candles with high < max(o, c)   {100 * v['high_below_body']:.1f} %",
        f"  candles with low > min(o, c)    {100 * v['low_above_body']:.1f} %",
        f"  candles with volume < 0         {100 * v['negative_volume']:.1f} %",
        f"  candles breaking any rule       {100 * v['any']:.1f} %",
    ])


def forecast_windows(predictor: KronosPredictor, windows: HeldOutWindows, cfg: CsvFinetuneConfig,
                     batch: int = 64) -> np.ndarray:
    """Mean forecast (N, predict, 6) float64 of every window, `batch` windows per generate call.

    Each context is normalised on its own (float32, as KronosPredictor.predict_batch does), the sample paths are
    averaged in normalised space and then scaled back: the same numbers as predict_batch, without DataFrames.
    """
    f = cfg.forecast
    x_stamps, y_stamps = windows.stamps()  # (N, L, 5), (N, P, 5)
    torch.manual_seed(f.seed)
    out = []
    for i in range(0, len(windows.context), batch):
        part = slice(i, i + batch)
        # Row-major (T, 6) float32 like KronosPredictor._prepare: numpy's sum order (so the last float32 bit of the
        # mean / std) depends on the memory layout, and this keeps the forecasts identical to predict_batch's.
        stats = [normalize(x, predictor.clip, axis=0) for x in windows.context[part].astype(np.float32)]
        xn = np.stack([s[0] for s in stats])  # (B, L, 6)
        paths = predictor.generate(xn, x_stamps[part], y_stamps[part], cfg.data.predict, T=f.temperature,
                                   top_k=f.top_k, top_p=f.top_p, sample_count=f.sample_count)  # (B, S, P, 6)
        out.extend(paths[b].mean(axis=0) * (std + 1e-5) + mean for b, (_, mean, std) in enumerate(stats))
    return np.stack(out).astype(np.float64)  # (N, predict, 6)


def plot_forecasts(windows: HeldOutWindows, forecast: np.ndarray, png: Path, max_panels: int = 4) -> Path:
    """Close of context tail, actual and forecast for the first windows of distinct series, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picks, seen = [], set()
    for i, name in enumerate(windows.names):  # one window per series first, then fill up
        if name not in seen:
            picks.append(i)
            seen.add(name)
    picks += [i for i in range(len(windows.names)) if i not in picks]
    picks = picks[:max_panels]
    fig, axes = plt.subplots(len(picks), 1, figsize=(9, 2.6 * len(picks)), dpi=100, squeeze=False)
    for ax, i in zip(axes[:, 0], picks):
        # Bar numbers on the x axis (0 = first forecast bar): trading calendars have nights and lunch breaks that a
        # time axis would draw as long flat lines. Both future lines start at the last context close.
        horizon = forecast.shape[1]
        tail = min(len(windows.context[i]), 3 * horizon)
        past = windows.context[i, -tail:, CLOSE]
        future_x = np.arange(-1, horizon)
        ax.plot(np.arange(-tail, 0), past, color="0.4", label="context")
        ax.plot(future_x, np.r_[past[-1], windows.actual[i, :, CLOSE]], color="tab:blue", label="actual")
        ax.plot(future_x, np.r_[past[-1], forecast[i, :, CLOSE]], color="tab:orange", label="forecast")
        ax.axvline(-0.5, color="0.7", linestyle="--", linewidth=0.8)
        ax.set_title(f"{windows.names[i]}: close, forecast from {windows.y_timestamps[i][0]} "
                     f"to {windows.y_timestamps[i][-1]}", fontsize=9)
        ax.set_xlabel("bars from the forecast start", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png


def forecast_table(windows: HeldOutWindows, forecast: np.ndarray) -> pd.DataFrame:
    """One row per forecast candle: window, series, timestamp, forecast and actual features."""
    rows = []
    for i, (name, ts) in enumerate(zip(windows.names, windows.y_timestamps)):
        part = pd.DataFrame(forecast[i], columns=[f"pred_{f}" for f in FEATURE_COLS])
        part[[f"actual_{f}" for f in FEATURE_COLS]] = windows.actual[i]
        part.insert(0, "timestamps", ts)
        part.insert(0, "series", name)
        part.insert(0, "window", i)
        rows.append(part)
    return pd.concat(rows, ignore_index=True)


def run_forecast(cfg: CsvFinetuneConfig, out_dir: Path | None = None) -> dict:
    """Load the finetuned models and the test split, forecast, write metrics/CSV/PNG, return the metrics."""
    if cfg.data.test_ratio <= 0:
        raise ValueError("data.test_ratio is 0: there is no held-out test split to forecast; set it > 0 "
                         "(and retrain, since the ratios move the split boundaries)")
    predictor_dir = best_dir(cfg.predictor_dir)
    if not (predictor_dir / "config.json").is_file():
        raise ValueError(f"no trained predictor in {predictor_dir}; run finetune_csv/train_sequential.py first")
    series = load_series(cfg.data)
    windows = held_out_windows(split_series(series, cfg.data)["test"], cfg.data.lookback, cfg.data.predict,
                               cfg.forecast.max_windows)
    tokenizer = KronosTokenizer.from_pretrained(predictor_tokenizer_source(cfg))
    model = Kronos.from_pretrained(predictor_dir)
    # max_context = lookback + predict: the window never slides, so the predictor sees sequences as long as the
    # training windows it was finetuned on (positions it has learned), context included.
    predictor = KronosPredictor(model, tokenizer, device="cuda:0" if torch.cuda.is_available() else "cpu",
                                max_context=cfg.data.lookback + cfg.data.predict, clip=cfg.data.clip, use_cache=True)
    forecast = forecast_windows(predictor, windows, cfg)
    metrics = score(forecast, windows)

    out_dir = Path(out_dir) if out_dir is not None else cfg.base_dir / "forecast"
    out_dir.mkdir(parents=True, exist_ok=True)
    forecast_table(windows, forecast).to_csv(out_dir / "forecast.csv", index=False)
    plot_forecasts(windows, forecast, out_dir / "forecast_vs_actual.png")
    write_json_atomic(metrics, out_dir / "metrics.json")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    cfg = csv_config.load(args.config, args.set)
    metrics = run_forecast(cfg)
    print(format_report(metrics))
    print(f"written: {cfg.base_dir / 'forecast'}/{{metrics.json, forecast.csv, forecast_vs_actual.png}}")
    return 0


if __name__ == "__main__":
    import sys

    from finetune.cli import run_script  # clean errors, exit codes, --debug, --help-config, --print-config

    sys.exit(run_script("forecast", main))
