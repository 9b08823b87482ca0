"""The candle contract (its one home) and the numpy feature functions every data path and the forecaster share.

A candle has FEATURES = open, high, low, close, volume, amount (in that order); its calendar stamp has
TIME_FEATURES = minute, hour, weekday (Monday=0), day of month, month. Normalisation is a per-feature z-score with
the population std, `(x - mean) / (std + 1e-5)`, clipped to [-clip, clip]; `denormalize` undoes it.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

FEATURES: tuple[str, ...] = ("open", "high", "low", "close", "volume", "amount")
PRICE_FEATURES: tuple[str, ...] = FEATURES[:4]
TIME_FEATURES: tuple[str, ...] = ("minute", "hour", "weekday", "day", "month")
CLOSE: int = FEATURES.index("close")
STD_EPS = 1e-5  # added to the std before dividing (a constant series normalises to 0, not NaN)


def normalize(x: np.ndarray, clip: float, *, axis: int = 0,
              stats_len: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-feature z-score along `axis`, clipped -> (x_norm, mean, std).

    Parameters
    ----------
    x: float array, e.g. (T, F) with axis=0 or a batch (B, F, W) with axis=-1.
    clip: x_norm is clipped to [-clip, clip].
    axis: the time axis.
    stats_len: use only the first `stats_len` steps along `axis` for mean/std (the lookback part of a training
        window: the future must not leak into its own normalisation); None = all steps.

    Returns
    -------
    x_norm (same shape and dtype as x), mean and std (x's shape with `axis` of size 1: keepdims), std is the
    population std (ddof=0). Bit-identical to the engine's `WindowDataset.get_batch` on its (B, F, W) block.
    """
    x = np.asarray(x)
    axis = axis % x.ndim
    n = x.shape[axis] if stats_len is None else int(stats_len)
    if not 1 <= n <= x.shape[axis]:
        raise ValueError(f"stats_len must be in [1, {x.shape[axis]}] (the length along axis {axis}), got {stats_len}")
    past = x if stats_len is None else np.take(x, np.arange(n), axis=axis)
    mean = past.mean(axis=axis, keepdims=True)
    centred = past - mean
    # Sum of squares through einsum over the moved-last axis: the same arithmetic order as window_dataset.
    moved = np.moveaxis(centred, axis, -1)
    sq = np.einsum("...w,...w->...", moved, moved)
    std = np.expand_dims(np.sqrt(sq / n), axis)
    out = x - mean
    out /= std + STD_EPS
    np.clip(out, -clip, clip, out=out)
    return out, mean, std


def denormalize(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Inverse of `normalize` (before clipping): `x * (std + 1e-5) + mean`, broadcasting mean/std as returned."""
    return x * (std + STD_EPS) + mean


def fill_amount(volume: np.ndarray, open_: np.ndarray, high: np.ndarray, low: np.ndarray,
                close: np.ndarray) -> np.ndarray:
    """Traded amount estimated from volume: `volume * mean(open, high, low, close)`, element-wise (any shape)."""
    return volume * ((open_ + high + low + close) / 4)


def to_datetime_index(timestamps, name: str = "timestamps") -> pd.DatetimeIndex:
    """Series / Index / list of datetimes -> DatetimeIndex; strings or numbers are rejected (ambiguous)."""
    values = pd.Index(timestamps)
    if not isinstance(values, pd.DatetimeIndex):
        raise ValueError(f"{name} must be datetimes (datetime64 Series/Index or pd.Timestamp values), got dtype "
                         f"{values.dtype}; convert with pd.to_datetime first")
    if values.hasnans:
        raise ValueError(f"{name} contains missing values (NaT)")
    return values


def check_increasing(timestamps: pd.DatetimeIndex, name: str = "timestamps") -> None:
    """Strictly increasing, or ValueError naming the first offending position."""
    if len(timestamps) > 1:
        bad = np.flatnonzero(np.diff(timestamps.asi8) <= 0)
        if bad.size:
            i = int(bad[0]) + 1
            raise ValueError(f"{name} must be strictly increasing; position {i} ({timestamps[i]}) does not come "
                             f"after position {i - 1} ({timestamps[i - 1]})")


def calc_time_stamps(timestamps) -> pd.DataFrame:
    """Calendar features (T, 5) in TIME_FEATURES order: minute, hour, weekday (Monday=0), day of month, month.

    Parameters
    ----------
    timestamps: T datetimes (datetime64 Series / Index or a list of pd.Timestamp).

    Returns
    -------
    DataFrame (T, 5) of ints, columns TIME_FEATURES.
    """
    ts = to_datetime_index(timestamps)
    return pd.DataFrame({"minute": ts.minute, "hour": ts.hour, "weekday": ts.day_of_week, "day": ts.day,
                         "month": ts.month})


def candle_matrix(df: pd.DataFrame, name: str = "df") -> np.ndarray:
    """DataFrame with open/high/low/close (+ optional volume/amount) -> float32 (T, 6) in FEATURES order.

    Missing `volume` -> volume and amount are 0; missing `amount` -> `fill_amount` (volume * mean(OHLC)).
    Raises ValueError naming the column for a missing price column, non-numeric data or NaN/inf.
    """
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"{name} must be a pandas DataFrame, got {type(df).__name__}")
    if len(df) == 0:
        raise ValueError(f"{name} is empty: at least one candle of context is needed")
    missing = [c for c in PRICE_FEATURES if c not in df.columns]
    if missing:
        raise ValueError(f"{name} is missing price columns {missing}; required: {list(PRICE_FEATURES)}")
    present = [c for c in FEATURES if c in df.columns]
    non_numeric = [c for c in present if not pd.api.types.is_numeric_dtype(df[c]) or pd.api.types.is_bool_dtype(df[c])]
    if non_numeric:
        raise ValueError(f"{name} has non-numeric columns {non_numeric} (dtypes "
                         f"{[str(df[c].dtype) for c in non_numeric]}); convert them to numbers")
    x = df[present].to_numpy(dtype=np.float64)
    bad = ~np.isfinite(x)
    if bad.any():
        rows, cols = np.nonzero(bad)
        raise ValueError(f"{name} has {int(bad.sum())} NaN/inf values, first in column {present[cols[0]]!r} at row "
                         f"{int(rows[0])}; fill or drop them before forecasting")
    cols = {c: x[:, j] for j, c in enumerate(present)}
    if "volume" not in cols:
        cols["volume"] = np.zeros(len(x))
        cols["amount"] = np.zeros(len(x))
    elif "amount" not in cols:
        cols["amount"] = fill_amount(cols["volume"], *(cols[c] for c in PRICE_FEATURES))
    return np.stack([cols[c] for c in FEATURES], axis=1).astype(np.float32)
