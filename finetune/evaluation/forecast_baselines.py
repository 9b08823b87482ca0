"""Naive forecasts in the model's sample layout, so the same scoring functions rate them.

A baseline forecast is a one-sample ensemble `(W, 1, H)`: its CRPS equals its absolute error, its quantiles all
equal the point forecast. `context (W, L)` holds the last L observed values of each window (the lookback), in time
order, `context[:, -1]` being the last observed close.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

DAYS_PER_WEEK = 5  # trading days: the season of daily bars


def persistence_samples(last_close: np.ndarray, horizon: int) -> np.ndarray:
    """Random-walk forecast: every future value equals the last observed one.

    Parameters
    ----------
    last_close : (W,); horizon : H.

    Returns
    -------
    (W, 1, H) float64.
    """
    last = np.asarray(last_close, dtype=np.float64)
    return np.repeat(last[:, None, None], horizon, axis=2)


def seasonal_naive_samples(context: np.ndarray, horizon: int, season: int) -> np.ndarray:
    """Seasonal-naive forecast: horizon h (1-based) repeats the value one season earlier, context[L - m + (h-1) % m].

    Parameters
    ----------
    context : (W, L) observed values with L >= season; horizon : H; season : m bars (e.g. bars per day).

    Returns
    -------
    (W, 1, H) float64.
    """
    context = np.asarray(context, dtype=np.float64)
    if season < 1:
        raise ValueError(f"season={season} must be >= 1")
    if context.ndim != 2 or context.shape[1] < season:
        raise ValueError(f"context of shape {context.shape} is shorter than one season ({season} bars); "
                         "lengthen the lookback or set the season explicitly")
    cols = context.shape[1] - season + (np.arange(horizon) % season)  # (H,)
    return context[:, None, cols]


def infer_season(timestamps) -> int:
    """Bars per trading day for intraday data, else 5 (a trading week of daily bars).

    Parameters
    ----------
    timestamps : (N,) datetimes of one series, ascending.

    Returns
    -------
    The season m in bars. Raises ValueError for spacings of more than a day (give the season explicitly).
    """
    stamps = pd.DatetimeIndex(pd.to_datetime(np.asarray(timestamps)))
    if len(stamps) < 2:
        raise ValueError("need at least two timestamps to infer the season; set it explicitly")
    step = pd.Series(stamps).diff().dropna().median()
    if step < pd.Timedelta(days=1):
        return int(pd.Series(stamps.normalize()).value_counts().median())
    if step <= pd.Timedelta(days=1):
        return DAYS_PER_WEEK
    raise ValueError(f"bars are {step} apart; the season cannot be inferred, set it explicitly")
