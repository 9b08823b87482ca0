"""Timestamps of the bars after the end of a series, for `forecast.py --future`.

Intraday bars: the bar times of a trading day (the session, lunch breaks included) are the times of day that occur
on at least half of the last `RECENT_DAYS` trading days of the history; trading days are the weekdays the history
trades on (Mon-Fri for a stock market, every day for crypto), or the dates of `forecast.calendar` when given (the
only way to know holidays). Daily bars: the next trading days, at the history's time of day. Longer spacings (weekly,
monthly): the last spacing repeated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

RECENT_DAYS = 20  # trading days of history that define the session's bar times
DAY = pd.Timedelta(days=1)


def read_calendar(path: str | Path) -> pd.DatetimeIndex:
    """Trading dates (normalised, sorted, unique) from the first column of a CSV file (`forecast.calendar`)."""
    frame = pd.read_csv(path)
    try:
        dates = pd.DatetimeIndex(pd.to_datetime(frame.iloc[:, 0])).normalize()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"forecast.calendar: the first column of {path} must hold dates ({exc})") from None
    if len(dates) == 0:
        raise ValueError(f"forecast.calendar: {path} lists no dates")
    return dates.unique().sort_values()


def _trading_days(history: pd.DatetimeIndex, after: pd.Timestamp, calendar: pd.DatetimeIndex | None, n_days: int,
                  name: str) -> list[pd.Timestamp]:
    """The first `n_days` trading dates >= the date of `after` (midnight timestamps)."""
    start = after.normalize()
    if calendar is not None:
        days = calendar[calendar >= start][:n_days]
        if len(days) < n_days:
            raise ValueError(f"series {name!r}: forecast.calendar has {len(days)} trading dates from {start.date()} "
                             f"on, {n_days} needed; extend the calendar file")
        return list(days)
    weekdays = set(history.day_of_week)
    days, day = [], start
    while len(days) < n_days:
        if day.weekday() in weekdays:
            days.append(day)
        day += DAY
    return days


def future_timestamps(history: pd.DatetimeIndex, n: int, calendar: pd.DatetimeIndex | None = None,
                      name: str = "series") -> pd.DatetimeIndex:
    """The `n` bar timestamps after the last one of `history` (ascending, unique).

    Parameters
    ----------
    history : (T,) bar times of one series, T >= 2; n : bars wanted; calendar : trading dates (None = the weekdays
    of the history); name : the series, named in errors.

    Returns
    -------
    (n,) DatetimeIndex, every entry after history[-1].
    """
    history = pd.DatetimeIndex(history)
    if len(history) < 2:
        raise ValueError(f"series {name!r} has {len(history)} rows: too few to tell its bar spacing")
    last = history[-1]
    step = pd.Series(history[-500:]).diff().dropna().median()
    if step > DAY:  # weekly / monthly bars: repeat the spacing
        return pd.DatetimeIndex([last + step * k for k in range(1, n + 1)])
    if step == DAY or step > pd.Timedelta(hours=12):  # daily bars, at the history's time of day
        days = _trading_days(history, last + DAY, calendar, n, name)
        return pd.DatetimeIndex([d + (last - last.normalize()) for d in days])
    recent_days = history.normalize().unique()[-RECENT_DAYS:]
    recent = history[history.normalize() >= recent_days[0]]
    counts = pd.Series(recent - recent.normalize()).value_counts()
    times = np.sort(counts[counts >= len(recent_days) / 2].index.to_numpy())  # session bar times of day
    out: list[pd.Timestamp] = []
    n_days = -(-n // len(times)) + 1  # the last day may be partly over
    for day in _trading_days(history, last, calendar, n_days, name):
        out.extend(t for t in (day + pd.Timedelta(x) for x in times) if t > last)
    return pd.DatetimeIndex(out[:n])
