"""Forecasting the test (or validation) days of a Qlib split: which bars get a forecast, the contexts, the model's
predicted closes, the four signals derived from them (last, mean, max, min) and the IC checkpoint-selection metric
for the predictor stage. Which bars, and each signal's formula and horizon: docs/architecture.md, "Formats and
designs"."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import pandas as pd
import torch

from finetune.qlib_io import range_bounds, time_major
from finetune.utils.store import SeriesPanel
from finetune.utils.windows import wallclock_stamps
from model.errors import ConfigError
from model.features import CLOSE

log = logging.getLogger("finetune.qlib")

# contexts (B, L, F) raw, context stamps (B, L, 5), forecast stamps (B, P, 5) -> predicted closes (B, P)
Forecaster = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def signal_horizon(signal: str, predict: int) -> int:
    """The label horizon a signal forecasts: P for last / max / min, ceil(P / 2) for mean, 1 for anything else
    (baselines such as momentum are scored at the backtest's own one-day holding)."""
    return {"last": predict, "max": predict, "min": predict, "mean": max(1, math.ceil(predict / 2))}.get(signal, 1)


def forecast_window_ends(split: SeriesPanel, start_ns: int, end_ns: int, lookback: int) -> np.ndarray:
    """Global row numbers t of every forecast: bar t inside [start, end] with `lookback` bars of its series
    ending at t. int64 (W,), ordered by series then time."""
    series = np.repeat(np.arange(split.n_series), split.lengths())  # (N,) series of each row
    position = np.arange(split.n_rows) - np.asarray(split.offsets)[series]  # (N,) bar number within the series
    when = np.asarray(split.datetimes)
    ok = (position >= lookback - 1) & (when >= start_ns) & (when <= end_ns)
    return np.flatnonzero(ok).astype(np.int64)


def context_rows(ends: np.ndarray, lookback: int) -> np.ndarray:
    """(W, lookback) row numbers of the contexts ending at `ends`."""
    return ends[:, None] - (lookback - 1) + np.arange(lookback)


def forecast_dates(calendar_ns: np.ndarray, after_ns: np.ndarray, n: int, freq: str) -> np.ndarray:
    """(W, n) int64 ns: the `n` trading days after each of `after_ns` (W,); past the calendar's end, business days
    for daily bars, else the last bar spacing."""
    cal = np.asarray(calendar_ns, dtype=np.int64)
    last = pd.Timestamp(int(cal[-1]))
    if freq.lower() in ("day", "1d", "d"):
        more = pd.bdate_range(last + pd.Timedelta(1, "D"), periods=n)
    else:
        step = int(cal[-1] - cal[-2]) if len(cal) > 1 else 60_000_000_000
        more = pd.DatetimeIndex([last + pd.Timedelta(step * (i + 1), "ns") for i in range(n)])
    cal = np.r_[cal, more.as_unit("ns").asi8].astype(np.int64)
    first = np.searchsorted(cal, after_ns, side="right")  # (W,) first calendar day after each context
    return cal[first[:, None] + np.arange(n)]


def signals_from_closes(pred_close: np.ndarray, last_close: np.ndarray) -> dict[str, np.ndarray]:
    """Predicted closes (W, P) and the last observed close (W,) -> predicted returns per signal, each (W,)."""
    base = last_close[:, None]
    return {"last": pred_close[:, -1] / last_close - 1.0, "mean": pred_close.mean(axis=1) / last_close - 1.0,
            "max": (pred_close / base).max(axis=1) - 1.0, "min": (pred_close / base).min(axis=1) - 1.0}


def kronos_forecaster(tokenizer, predictor, cfg, device: str) -> Forecaster:
    """A Forecaster running `KronosPredictor.sample_windows` with cfg.data's window and cfg.forecast's sampling
    (each context normalised with its own statistics, the mean of `sample_count` paths, de-normalised) and keeping
    the close. It draws from torch's global generator: `forecast_frame(seed=...)` seeds it right before the first
    batch, so each forecaster's draws depend on its own seed only."""
    from model import KronosPredictor

    d, f = cfg.data, cfg.forecast
    kp = KronosPredictor.from_models(predictor, tokenizer, device=device, max_context=d.max_context, clip=d.clip)

    def forecast(x: np.ndarray, x_stamp: np.ndarray, y_stamp: np.ndarray) -> np.ndarray:
        _, mean = kp.sample_windows(x, x_stamp, y_stamp, d.predict, T=f.temperature, top_k=f.top_k, top_p=f.top_p,
                                    sample_count=f.sample_count)  # (B, P, 6)
        return mean[..., CLOSE]  # (B, P)

    return forecast


def forecast_frame(split: SeriesPanel, ends: np.ndarray, calendar_ns: np.ndarray, forecaster: Forecaster, *,
                   lookback: int, predict: int, freq: str, batch: int, seed: int | None = None) -> pd.DataFrame:
    """One row per forecast bar: datetime, instrument and the four signals (docs/architecture.md), for the
    window ends `ends` (W,) of `split`, `batch` windows per forecaster call, dated by the market calendar
    `calendar_ns`. `seed` seeds torch / numpy right before the first batch (a sampling forecaster's draws then do
    not depend on what ran before it)."""
    if seed is not None:
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
    closes = np.empty((len(ends), predict), dtype=np.float64)
    future = forecast_dates(calendar_ns, np.asarray(split.datetimes)[ends], predict, freq)  # (W, P) ns
    for lo in range(0, len(ends), max(1, batch)):
        hi = min(lo + max(1, batch), len(ends))
        rows = context_rows(ends[lo:hi], lookback)  # (B, L)
        y_stamp = wallclock_stamps(future[lo:hi].ravel()).reshape(hi - lo, predict, 5)  # (B, P, 5)
        closes[lo:hi] = forecaster(time_major(split, rows).astype(np.float64), np.asarray(split.stamps)[rows], y_stamp)
    last_close = np.asarray(split.features[CLOSE])[ends].astype(np.float64)
    series = np.searchsorted(np.asarray(split.offsets), ends, side="right") - 1
    return pd.DataFrame({
        "datetime": pd.DatetimeIndex(np.asarray(split.datetimes)[ends].astype("datetime64[ns]")),
        "instrument": np.asarray([str(n) for n in split.names])[series],
        **signals_from_closes(closes, last_close),
    })


def panel_labels(split: SeriesPanel, ends: np.ndarray, calendar_ns: np.ndarray, horizon: int,
                 price_row: int = CLOSE) -> np.ndarray:
    """Trade labels price(t+1+h) / price(t+1) - 1 from the panel itself, on the market calendar: NaN unless the
    bars t+1 and t+1+h of t's series are the calendar's next and (1+h)-th next days (no reach over a missing day).
    (W,) float64. The same label as finetune/evaluation/signals.py, without a Qlib provider."""
    offsets = np.asarray(split.offsets)
    when = np.asarray(split.datetimes)
    cal = np.asarray(calendar_ns, dtype=np.int64)
    series = np.searchsorted(offsets, ends, side="right") - 1
    out = np.full(len(ends), np.nan)
    enter, leave = ends + 1, ends + 1 + horizon
    ok = leave < offsets[series + 1]
    pos = np.searchsorted(cal, when[ends])
    ok &= pos + 1 + horizon < len(cal)
    idx = np.flatnonzero(ok)
    idx = idx[(when[enter[idx]] == cal[pos[idx] + 1]) & (when[leave[idx]] == cal[pos[idx] + 1 + horizon])]
    price = np.asarray(split.features[price_row])
    out[idx] = price[leave[idx]].astype(np.float64) / price[enter[idx]] - 1.0
    return out


def make_ic_val_metric(cfg, val_panel: SeriesPanel, tokenizer, calendar_ns: np.ndarray, *, max_days: int = 20,
                       device: str | None = None) -> Callable:
    """Checkpoint selection by IC (`training.select_by: ic`): a callable(model) -> {"score", ...} that forecasts
    up to `max_days` evenly spaced validation days (every member stock on them) with `model` and `tokenizer` and
    scores the daily RankIC of the `last` signal against the P-day trade label (backtest.deal_price) computed on the
    market calendar `calendar_ns` (the processed manifest's): {"score": -mean RankIC (lower is better,
    like a loss), "rank_ic", "ic", "days"}. A call costs max_days x stocks x sample_count sequences."""
    from finetune.evaluation.signals import analyse_signal

    d, f = cfg.data, cfg.forecast
    start, end = (t.value for t in range_bounds(d.val_time_range))  # the end date inclusive
    ends = forecast_window_ends(val_panel, start, end, d.lookback)
    price_row = {"open": 0, "close": CLOSE}.get(cfg.backtest.deal_price, CLOSE)
    labels = panel_labels(val_panel, ends, calendar_ns, d.predict, price_row)
    ends, labels = ends[np.isfinite(labels)], labels[np.isfinite(labels)]  # days whose label the panel holds
    days = np.unique(np.asarray(val_panel.datetimes)[ends])
    if len(days):
        days = days[np.unique(np.linspace(0, len(days) - 1, min(max_days, len(days))).round().astype(int))]
    keep = np.isin(np.asarray(val_panel.datetimes)[ends], days)
    ends, labels = ends[keep], labels[keep]
    if len(ends) == 0:
        raise ConfigError(["data.val_time_range: no validation day has a forecast and a finite label; widen the range"])

    def metric(model) -> dict:
        was_training = model.training
        forecaster = kronos_forecaster(tokenizer, model, cfg, device or str(next(model.parameters()).device))
        try:
            frame = forecast_frame(val_panel, ends, calendar_ns, forecaster, lookback=d.lookback, predict=d.predict,
                                   freq=d.freq, batch=max(1, f.batch_size // f.sample_count), seed=f.seed)
        finally:
            model.train(was_training)
        frame = frame.set_index(["datetime", "instrument"])
        label = pd.DataFrame({f"label_{d.predict}": labels}, index=frame.index)
        stats = analyse_signal(frame["last"], label)[f"label_{d.predict}"]
        rank_ic = stats["rank_ic"]["mean"]
        score = -rank_ic if math.isfinite(rank_ic) else 0.0
        return {"score": float(score), "rank_ic": float(rank_ic), "ic": float(stats["ic"]["mean"]),
                "days": int(stats["days"])}

    return metric
