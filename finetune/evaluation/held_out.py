"""Held-out windows of a split (`held_out_windows`: its windows as arrays, with their bar times) and their sampled
forecasts (`sample_paths`), which checkpoint selection, calibration, the forecast and the walk-forward score.

The evaluation package may import the engine's generic helpers (finetune/utils); the engine never imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from finetune.evaluation.forecast_scores import crps_ensemble
from finetune.utils.safety import raise_if_stop_requested
from finetune.utils.windows import PanelSegments
from model.config import Window
from model.features import CLOSE, calc_time_stamps


@dataclass
class HeldOutWindows:
    """N windows: context candles and the candles that really followed."""

    names: list[str]  # (N,) series of each window; the windows of one series are contiguous and in time order.
    context: np.ndarray  # (N, lookback, 6) float64 context candles (columns FEATURES).
    x_timestamps: list[pd.DatetimeIndex]  # N context time indexes (lookback each).
    y_timestamps: list[pd.DatetimeIndex]  # N forecast time indexes (predict each).
    actual: np.ndarray  # (N, predict, 6) float64 the candles that really followed.
    # (N, T) float64 closes ending at each window's last context bar, T <= `held_out_windows(history=)`: the series' own
    # earlier bars, beyond the lookback (the `empirical` baseline's paths); None when not asked for.
    history: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.names)

    def stamps(self) -> tuple[np.ndarray, np.ndarray]:
        """Calendar stamps of the contexts (N, lookback, 5) and of the forecast bars (N, predict, 5), int64."""
        return tuple(np.stack([calc_time_stamps(t).to_numpy(np.int64) for t in index])  # (N, T, 5)
                     for index in (self.x_timestamps, self.y_timestamps))

    def subset(self, idx: np.ndarray) -> HeldOutWindows:
        """The windows at positions `idx` (in that order)."""
        idx = np.asarray(idx, dtype=np.int64)
        return HeldOutWindows([self.names[i] for i in idx], self.context[idx], [self.x_timestamps[i] for i in idx],
                              [self.y_timestamps[i] for i in idx], self.actual[idx],
                              None if self.history is None else self.history[idx])

    def dates(self) -> np.ndarray:
        """(N,) int64 ns time of each window's last context bar: windows of different series on one date match."""
        return np.array([ts[-1].value for ts in self.x_timestamps], dtype=np.int64)


def spread_evenly(n_available: int, n_wanted: int) -> np.ndarray:
    """Indices of min(n_wanted, n_available) items spread evenly over range(n_available), first and last included
    (none of none: linspace of 0 points is empty)."""
    k = min(n_wanted, n_available)
    return np.unique(np.round(np.linspace(0, n_available - 1, k)).astype(np.int64))


def held_out_windows(segments: PanelSegments, window: Window, stride: int | None = None,
                     max_windows: int | None = None, history: int = 0) -> HeldOutWindows:
    """Every `window` of each series' range of a split (its panel with datetimes), starts `stride` rows apart (None
    = window.predict: non-overlapping), series in panel order and windows in time order; only the windows' columns
    are read.

    max_windows: optional cap per series (evenly spread, first and last included).
    history: also cut the closes of the `history` bars ending at each window's last context bar, from the whole
        series (earlier splits included); fewer (the same for all windows) when a series starts later."""
    panel = segments.panel
    if panel.datetimes is None:
        raise ValueError("held-out windows need the bar times: this panel has no datetimes")
    lookback = window.lookback
    stride = window.predict if stride is None else stride
    names, columns, series_first = [], [], []
    for s, (lo, hi) in enumerate(zip(segments.start.tolist(), segments.stop.tolist())):
        starts = np.arange(0, hi - lo - window.size + 1, stride, dtype=np.int64)
        if max_windows is not None:
            starts = starts[spread_evenly(len(starts), max_windows)]
        names += [panel.names[s]] * len(starts)
        columns.append(lo + starts)
        series_first.append(np.full(len(starts), int(panel.offsets[s]), dtype=np.int64))
    first = np.concatenate(columns) if columns else np.zeros(0, dtype=np.int64)  # (N,) window start columns
    past = None
    if history > 0:
        ends = first + lookback  # (N,) one past each window's last context column
        n_bars = int(min(history, (ends - np.concatenate(series_first)).min(initial=history)))
        past = np.asarray(panel.features[CLOSE][ends[:, None] - n_bars + np.arange(n_bars)], dtype=np.float64)
    cols = first[:, None] + np.arange(window.size, dtype=np.int64)  # (N, W) panel columns of each window
    values = np.moveaxis(np.asarray(panel.features[:, cols], dtype=np.float64), 0, -1)  # (N, W, 6)
    when = np.asarray(panel.datetimes)[cols]  # (N, W) int64 ns, naive wall-clock time
    as_index = lambda ns: pd.DatetimeIndex(ns.astype("datetime64[ns]"))
    return HeldOutWindows(names, values[:, :lookback].copy(), [as_index(w[:lookback]) for w in when],
                          [as_index(w[lookback:]) for w in when], values[:, lookback:].copy(), past)


def sample_paths(predictor: Any, context: np.ndarray, x_stamps: np.ndarray, y_stamps: np.ndarray,
                 predict: int, sampling: Any, batch: int = 32, *, interruptible: bool = True) -> np.ndarray:
    """Sampled future candles (N, S, P, 6) float64 of every window, in price units, from context (N, L, 6) and
    stamps x (N, L, 5), y (N, P, 5) by `predictor.sample_windows`, `batch` windows per forward pass, seeded once
    with sampling.seed before the first. `interruptible`: a stop request (SIGTERM) ends the sampling before each batch
    with `TrainingStopped` (False inside the training loop's validation, which stops after its own checkpoint)."""
    torch.manual_seed(sampling.seed)
    out = []
    for lo in range(0, len(context), batch):
        if interruptible:
            raise_if_stop_requested("while sampling forecasts")
        part = slice(lo, lo + batch)
        samples, _ = predictor.sample_windows(context[part], x_stamps[part], y_stamps[part], predict,
                                              T=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                              sample_count=sampling.sample_count)  # (B, S, P, 6) price units
        out.append(samples)
    return np.concatenate(out).astype(np.float64) if out else np.zeros((0, sampling.sample_count, predict, 6))


def window_crps_mae(paths: np.ndarray, windows: HeldOutWindows) -> tuple[np.ndarray, np.ndarray]:
    """Per-window mean (fair) CRPS and MAE of the sample median (W,) of the close, in returns from the last context
    close; `paths`: the windows' sampled candles (W, S, P, 6)."""
    last = windows.context[:, -1, CLOSE]  # (W,)
    obs = windows.actual[..., CLOSE] / last[:, None] - 1.0  # (W, P)
    ens = np.moveaxis(paths[..., CLOSE] / last[:, None, None] - 1.0, 1, -1)  # (W, P, S)
    return crps_ensemble(obs, ens, fair=True).mean(axis=1), np.abs(np.median(ens, axis=-1) - obs).mean(axis=1)
