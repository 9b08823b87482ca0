"""Candle features for the forecaster: column checks, volume/amount filling, calendar stamps, normalisation."""
from __future__ import annotations

import numpy as np
import pandas as pd

PRICE_COLS = ["open", "high", "low", "close"]
FEATURE_COLS = PRICE_COLS + ["volume", "amount"]
TIME_COLS = ["minute", "hour", "weekday", "day", "month"]


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
    """Calendar features (T, 5): minute, hour, weekday (Monday=0), day of month, month."""
    ts = to_datetime_index(timestamps)
    return pd.DataFrame({"minute": ts.minute, "hour": ts.hour, "weekday": ts.day_of_week, "day": ts.day,
                         "month": ts.month})


def candle_matrix(df: pd.DataFrame, name: str = "df") -> np.ndarray:
    """DataFrame with open/high/low/close (+ optional volume/amount) -> float32 (T, 6) in FEATURE_COLS order.

    Missing `volume` -> volume and amount are 0; missing `amount` -> volume * mean(open, high, low, close).
    """
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"{name} must be a pandas DataFrame, got {type(df).__name__}")
    if len(df) == 0:
        raise ValueError(f"{name} is empty: at least one candle of context is needed")
    missing = [c for c in PRICE_COLS if c not in df.columns]
    if missing:
        raise ValueError(f"{name} is missing price columns {missing}; required: {PRICE_COLS}")
    present = [c for c in FEATURE_COLS if c in df.columns]
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
    out = pd.DataFrame(x, columns=present)
    if "volume" not in out:
        out["volume"] = 0.0
        out["amount"] = 0.0
    elif "amount" not in out:
        out["amount"] = out["volume"] * out[PRICE_COLS].mean(axis=1)
    return out[FEATURE_COLS].to_numpy(dtype=np.float32)


def normalize(x: np.ndarray, clip: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column z-score over the time axis of x (T, F), clipped -> (x_norm, mean, std). Population std, +1e-5."""
    mean, std = x.mean(axis=0), x.std(axis=0)
    return np.clip((x - mean) / (std + 1e-5), -clip, clip), mean, std
