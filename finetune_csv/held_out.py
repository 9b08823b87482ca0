"""Held-out windows of the CSV pipeline and their sampled forecasts, as arrays end to end.

A window is `lookback` context candles followed by `predict` candles to forecast, cut from one series' range of a split
of the prepared store (finetune/utils/data/panel_split.py `PanelSegments`: the test or validation split plus the
`lookback` rows before it, so every forecast row belongs to the split; the same store and splits training reads).
`held_out_windows` takes EVERY window `stride` rows apart (stride = predict: the horizons tile
the split without overlap); `sample_paths` draws `sample_count` sample paths per window with
KronosPredictor.generate and scales them back to prices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from finetune.utils.data.panel_split import PanelSegments
from model import KronosPredictor
from model.features import FEATURES, calc_time_stamps, normalize

CLOSE = FEATURES.index("close")


@dataclass
class HeldOutWindows:
    """N windows: context candles and the candles that really followed."""

    names: list[str]
    """(N,) series of each window; the windows of one series are contiguous and in time order."""
    context: np.ndarray
    """(N, lookback, 6) float64 context candles (columns FEATURES)."""
    x_timestamps: list[pd.DatetimeIndex]
    """N context time indexes (lookback each)."""
    y_timestamps: list[pd.DatetimeIndex]
    """N forecast time indexes (predict each)."""
    actual: np.ndarray
    """(N, predict, 6) float64 the candles that really followed."""

    def __len__(self) -> int:
        return len(self.names)

    def stamps(self) -> tuple[np.ndarray, np.ndarray]:
        """Calendar stamps of the contexts (N, lookback, 5) and of the forecast bars (N, predict, 5), int64."""
        as_array = lambda ts: calc_time_stamps(ts).to_numpy(np.int64)  # (T, 5)
        return (np.stack([as_array(ts) for ts in self.x_timestamps]),
                np.stack([as_array(ts) for ts in self.y_timestamps]))

    def subset(self, idx: np.ndarray) -> HeldOutWindows:
        """The windows at positions `idx` (in that order)."""
        idx = np.asarray(idx, dtype=np.int64)
        return HeldOutWindows([self.names[i] for i in idx], self.context[idx], [self.x_timestamps[i] for i in idx],
                              [self.y_timestamps[i] for i in idx], self.actual[idx])


def spread_evenly(n_available: int, n_wanted: int) -> np.ndarray:
    """Indices of min(n_wanted, n_available) items spread evenly over range(n_available), first and last included."""
    if n_available < 1:
        return np.zeros(0, dtype=np.int64)
    k = min(n_wanted, n_available)
    return np.unique(np.round(np.linspace(0, n_available - 1, k)).astype(np.int64))


def held_out_windows(segments: PanelSegments, lookback: int, predict: int, stride: int | None = None,
                     max_windows: int | None = None) -> HeldOutWindows:
    """Every window of each series' range of a split, starts `stride` rows apart (None = predict: non-overlapping).

    Parameters
    ----------
    segments : a split of the prepared store (`prepare_data(...).splits["test"]` or `["val"]`); its panel must
        carry `datetimes` (the store's always do). Nothing but the windows' columns is read from the memory map.
    lookback, predict : window shape in rows; stride : rows between window starts;
    max_windows : optional cap per series (evenly spread, first and last included).

    Returns
    -------
    HeldOutWindows, series in panel order and windows in time order: context (N, lookback, 6) and actual
    (N, predict, 6) float64 (the store's float32 values, widened), timestamps from `panel.datetimes`.
    """
    panel = segments.panel
    if panel.datetimes is None:
        raise ValueError("held-out windows need the bar times: this panel has no datetimes")
    stride = predict if stride is None else stride
    window = lookback + predict
    names, columns = [], []
    for s, (lo, hi) in enumerate(zip(segments.start.tolist(), segments.stop.tolist())):
        starts = np.arange(0, hi - lo - window + 1, stride, dtype=np.int64)
        if max_windows is not None:
            starts = starts[spread_evenly(len(starts), max_windows)]
        names += [panel.names[s]] * len(starts)
        columns.append(lo + starts)
    first = np.concatenate(columns) if columns else np.zeros(0, dtype=np.int64)  # (N,) window start columns
    cols = first[:, None] + np.arange(window, dtype=np.int64)  # (N, W) panel columns of each window
    values = np.moveaxis(np.asarray(panel.features[:, cols], dtype=np.float64), 0, -1)  # (N, W, 6)
    when = np.asarray(panel.datetimes)[cols]  # (N, W) int64 ns, naive wall-clock time
    as_index = lambda ns: pd.DatetimeIndex(ns.astype("datetime64[ns]"))
    return HeldOutWindows(names, values[:, :lookback].copy(), [as_index(w[:lookback]) for w in when],
                          [as_index(w[lookback:]) for w in when], values[:, lookback:].copy())


def sample_paths(predictor: KronosPredictor, context: np.ndarray, x_stamps: np.ndarray, y_stamps: np.ndarray,
                 predict: int, sampling, batch: int = 32) -> np.ndarray:
    """Sampled future candles of every window, in price units.

    Each context is normalised on its own (float32, row-major, as KronosPredictor.predict_batch does) and each
    sample path is scaled back with its window's mean / std, so the mean over samples equals predict_batch's
    forecast. `torch.manual_seed(sampling.seed)` is set once before the first batch.

    Parameters
    ----------
    predictor : the model pair; context : (N, L, 6) candles; x_stamps : (N, L, 5); y_stamps : (N, P, 5);
    predict : P; sampling : object with temperature, top_k, top_p, sample_count, seed; batch : windows per call.

    Returns
    -------
    (N, S, P, 6) float64 sample paths.
    """
    torch.manual_seed(sampling.seed)
    out = []
    for lo in range(0, len(context), batch):
        part = slice(lo, lo + batch)
        # Row-major (T, 6) float32 like KronosPredictor._prepare: numpy's sum order (so the last float32 bit of the
        # mean / std) depends on the memory layout, and this keeps the forecasts identical to predict_batch's.
        stats = [normalize(x, predictor.clip, axis=0) for x in np.asarray(context[part], dtype=np.float32)]
        xn = np.stack([s[0] for s in stats])  # (B, L, 6)
        paths = predictor.generate(xn, x_stamps[part], y_stamps[part], predict, T=sampling.temperature,
                                   top_k=sampling.top_k, top_p=sampling.top_p,
                                   sample_count=sampling.sample_count)  # (B, S, P, 6) normalised
        out.extend(paths[b] * (std + 1e-5) + mean for b, (_, mean, std) in enumerate(stats))
    return np.stack(out).astype(np.float64) if out else np.zeros((0, sampling.sample_count, predict, 6))
