"""Cleaning rules for one parsed series (the CSV pipeline's) and wall-clock time stamps.

Rules, in this order: unsorted timestamps are sorted (stable) with a warning; duplicate timestamps are an error;
missing values follow the NaN policy (error names column and rows; ffill carries the last value forward, a missing
first value stays an error; drop removes the rows and warns); then a missing amount column becomes
volume * mean(open, high, low, close), computed in float64 exactly as the CSV pipeline does.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from model.features import fill_amount

from .streaming_reader import FEATURES, SourceProblems

__all__ = ["clean_series", "wallclock_stamps"]

_NS_PER_DAY = 86_400_000_000_000
_NS_PER_MINUTE = 60_000_000_000
_MAX_LISTED = 5


def _listed(lines: np.ndarray) -> str:
    shown = ", ".join(str(int(v)) for v in lines[:_MAX_LISTED])
    return shown + (f" (+{len(lines) - _MAX_LISTED} more)" if len(lines) > _MAX_LISTED else "")


def clean_series(ts: np.ndarray, values: np.ndarray, lines: np.ndarray, present: tuple[bool, ...], nan_policy: str,
                 where: str, unit: str = "line(s)") -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Apply the cleaning rules to one series.

    Parameters
    ----------
    ts: (n,) int64 wall-clock ns, in file order.
    values: (n, 6) float64 open..amount, NaN = missing; absent columns are 0.
    lines: (n,) int64 where each row is in its file (for messages).
    present: per feature, whether the file has the column.
    nan_policy: error | ffill | drop.
    where: the file (and series) for messages.

    Returns
    -------
    (ts (m,), values (m, 6) float64, warnings); raises SourceProblems on duplicates or refused missing values.
    """
    notes: list[str] = []
    if len(ts) > 1 and (np.diff(ts) < 0).any():
        notes.append(f"{where}: timestamps are not sorted; sorting them (rows keep their values)")
        perm = np.argsort(ts, kind="stable")
        ts, values, lines = ts[perm], values[perm], lines[perm]
    same = np.flatnonzero(np.diff(ts) == 0)
    if same.size:
        first = ts[same[0]]
        raise SourceProblems([(f"{where}: {same.size} duplicate timestamp(s), first {pd.Timestamp(first)} at {unit} "
                               f"{_listed(lines[ts == first])}; remove the duplicates (or set data.symbol_column "
                               "if the file holds several series)")])
    cols = [i for i, p in enumerate(present) if p]
    nan = np.isnan(values[:, cols])  # (n, n_present)
    if nan.any():
        if nan_policy == "error":
            details = [f"column {FEATURES[c]} at {unit} {_listed(lines[nan[:, j]])}"
                       for j, c in enumerate(cols) if nan[:, j].any()]
            raise SourceProblems([f"{where}: missing values in " + "; ".join(details) +
                                  " (data.nan_policy: error; set it to ffill or drop to repair them)"])
        if nan_policy == "ffill":
            if nan[0].any():
                which = ", ".join(FEATURES[c] for j, c in enumerate(cols) if nan[0, j])
                raise SourceProblems([(f"{where}: missing value(s) in the first row ({which}) cannot be "
                                       "forward-filled (data.nan_policy: ffill); fix or drop that row")])
            notes.append(f"{where}: forward-filling {int(nan.sum())} missing value(s) (data.nan_policy: ffill)")
            values = values.copy()
            idx = np.arange(len(ts))
            for j, c in enumerate(cols):
                if nan[:, j].any():
                    last = np.maximum.accumulate(np.where(nan[:, j], 0, idx))  # last valid row at or before each
                    values[:, c] = values[last, c]
        else:
            rows = nan.any(axis=1)
            notes.append(f"{where}: dropping {int(rows.sum())} row(s) with missing values (data.nan_policy: drop)")
            ts, values = ts[~rows], values[~rows]
    if present[4] and not present[5]:
        values = np.array(values, dtype=np.float64, copy=True)
        # The forecaster derives a missing amount the same way, so training and inference see the same features.
        values[:, 5] = fill_amount(*(values[:, i] for i in (4, 0, 1, 2, 3)))  # volume, open, high, low, close
    return ts, values, notes


def wallclock_stamps(ts: np.ndarray) -> np.ndarray:
    """Calendar stamps of naive wall-clock ns times: int64 (n, 5) minute, hour, weekday (Monday=0), day, month
    (equal to model.features.calc_time_stamps of the same times)."""
    ts = np.asarray(ts, dtype=np.int64)
    days = ts // _NS_PER_DAY  # floor: times before 1970 count back correctly
    minute_of_day = (ts - days * _NS_PER_DAY) // _NS_PER_MINUTE
    d = days.astype("datetime64[D]")
    month_start = d.astype("datetime64[M]")
    out = np.empty((len(ts), 5), dtype=np.int64)
    out[:, 0] = minute_of_day % 60
    out[:, 1] = minute_of_day // 60
    out[:, 2] = (days + 3) % 7  # 1970-01-01 was a Thursday
    out[:, 3] = (d - month_start).astype(np.int64) + 1
    out[:, 4] = month_start.astype(np.int64) % 12 + 1
    return out
