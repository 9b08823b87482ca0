"""A user's long frame of candles read as series (`read_frame`: what `KronosPredictor.predict_df` forecasts), and
the reading of timestamp cells both doors share: integers are epoch times in the unit given (predict_df's
timestamp_unit=, data.timestamp_unit), else in the one their magnitude implies (`epoch_unit`)."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from model.calendar import TradingCalendar
from model.errors import DataError
from model.features import (
    ADJUST,
    PRICE_FEATURES,
    ColumnError,
    adj_close_column,
    adjust_prices,
    check_increasing,
    resolve_columns,
    timestamp_parts,
    to_datetime_index,
)

EPOCH_UNITS = ("s", "ms", "us", "ns")
EPOCH_MIN = 1e8  # the smallest magnitude read as an epoch: 1973-03 in seconds; 20240102 (a date) stays a date
ID_HINTS = ("symbol", "ticker", "code", "instrument", "asset", "pair", "name", "series", "stock")


def epoch_unit(values: np.ndarray, unit: str | None = None, where: str = "timestamps") -> str | None:
    """The epoch unit of integer stamps `values (N,)`: `unit` checked, else the one their median magnitude implies
    (1973-2262 is ~1e9 in s, 1e12 ms, 1e15 us, 1e18 ns), else None below EPOCH_MIN (a date such as 20240102)."""
    if unit is not None:
        if unit not in EPOCH_UNITS:
            raise DataError(f"{where}: timestamp unit {unit!r} must be one of {list(EPOCH_UNITS)}")
        return unit
    m = float(np.median(np.abs(np.asarray(values, dtype=np.float64)))) if len(values) else 0.0
    return None if m < EPOCH_MIN else EPOCH_UNITS[min(3, int(np.log10(m / EPOCH_MIN) // 3))]


def read_stamps(values: Any, where: str, unit: str | None = None) -> pd.DatetimeIndex:
    """Datetimes kept (their zone too), epoch integers in `unit` or the `epoch_unit` of their magnitude, text parsed
    by pandas (its format-inference warning silenced: the error raised names the column and the fix)."""
    s = values if isinstance(values, pd.DatetimeIndex) else pd.Series(values)
    if not pd.api.types.is_datetime64_any_dtype(s):
        ints = pd.api.types.is_integer_dtype(s) or (pd.api.types.is_float_dtype(s) and np.all(np.mod(s, 1) == 0))
        unit = epoch_unit(np.asarray(s), unit, where) if ints else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                s = (pd.to_datetime(np.asarray(s, dtype=np.int64), unit=unit) if unit else
                     pd.to_datetime(s.astype(str), format="%Y%m%d") if ints else pd.to_datetime(s))
        except (ValueError, TypeError, OverflowError) as e:
            raise ColumnError(f"{where} holds values that are not datetimes ({e}); convert them with "
                              "pd.to_datetime(..., format=...), or give the epoch unit (timestamp_unit=)") from None
    return to_datetime_index(s, where)


@dataclass
class FrameSeries:
    """The series of a long frame, all checked: `candles` (N, <= 6) FEATURES columns of every row, `stamps` (N,),
    and per series (id, its row numbers sorted by time, the stamps of its forecast)."""

    candles: pd.DataFrame
    stamps: pd.DatetimeIndex
    series: list[tuple[Any, np.ndarray, pd.DatetimeIndex]]
    id_column: str | None
    ts_name: str

    def name(self, sid: Any) -> str:  # what messages call a series
        return f"series {sid!r}" if self.id_column else "df"

    def frame(self, rows: np.ndarray) -> pd.DataFrame:
        """One series' candles indexed by its stamps (messages then name a bad row by its time)."""
        return self.candles.iloc[rows].set_axis(self.stamps[rows])


def read_frame(df: pd.DataFrame, prediction_length: int, *, id_column: str | None = None,
               timestamp_column: str | None = None, columns: Mapping[str, str | None] | None = None,
               freq: str | None = None, calendar: TradingCalendar | None = None, future: Any = None,
               adjust: str = "none", timestamp_unit: str | None = None, holidays: str | None = None) -> FrameSeries:
    """The series of `df` and their forecast stamps, as `KronosPredictor.predict_df` documents its arguments."""
    where = "predict_df's df"
    if not isinstance(df, pd.DataFrame):
        raise DataError(f"df must be a pandas DataFrame, got {type(df).__name__}")
    if len(df) == 0:
        raise DataError("df is empty: no series to forecast")
    names = [str(c) for c in df.columns]
    if id_column is None:
        id_column = next((c for c in names if c.lower() == "id"), None)
    elif str(id_column) not in names:
        raise ColumnError(f"{where} has no id column {id_column!r}; pass id_column= one of {names[:12]}, or None "
                          "for a frame of one series")
    explicit = dict(columns or {})
    if timestamp_column is not None:
        explicit["timestamps"] = timestamp_column
    rest = [c for c in names if c != id_column]
    flat = df.set_axis(names, axis=1)
    parts = timestamp_parts(rest, explicit.get("timestamps", "timestamps"))  # e.g. ['Date', 'Time']
    if parts:  # their text joined by a space is the timestamp, named 'Date+Time' in the output
        rest = [c for c in rest if c not in parts]
        explicit["timestamps"] = None
    try:
        mapping = resolve_columns(rest, explicit, where=where)
    except ColumnError:
        if "timestamps" in explicit or not isinstance(df.index, pd.DatetimeIndex):
            raise
        mapping = resolve_columns(rest, {**explicit, "timestamps": None}, where=where)
    ts_name = "+".join(parts) if parts else mapping["timestamps"]
    stamps = read_stamps(flat[parts].astype(str).agg(" ".join, axis=1) if parts else
                         df.index if mapping["timestamps"] is None else flat[mapping["timestamps"]],
                         f"{where}: column {ts_name or 'timestamps'!r}", timestamp_unit)
    candles = pd.DataFrame({c: flat[n].to_numpy() for c, n in mapping.items() if n and c != "timestamps"})
    adj = adj_close_column(rest)
    if adjust not in ADJUST or (adjust == "adj_close" and adj in (None, mapping["close"])):
        raise DataError(f"{where}: adjust={adjust!r} must be one of {list(ADJUST)}, and adj_close needs an 'Adj "
                        "Close' column beside the unadjusted close (map close to it)")
    if adjust == "adj_close":
        prices = list(PRICE_FEATURES)
        candles[prices] = adjust_prices(candles[prices].to_numpy(np.float64), flat[adj].to_numpy(np.float64))
    keys = flat[id_column].to_numpy() if id_column else np.zeros(len(df), dtype=np.int64)
    if pd.isna(keys).any():
        raise DataError(f"column {id_column!r} has missing ids; every row must belong to a series")
    ids = [c for c in rest if c not in mapping.values() and c != adj and (c.lower() in ID_HINTS or not
           pd.api.types.is_numeric_dtype(flat[c]))] if not id_column else []
    series = []
    for sid, rows in pd.Series(np.arange(len(df))).groupby(keys, sort=False):
        rows = rows.to_numpy()[np.argsort(stamps[rows.to_numpy()].asi8, kind="stable")]
        label = f"series {sid!r}" if id_column else "the series (no id column)"
        try:  # duplicates: e.g. several series and no id column
            check_increasing(stamps[rows], f"the timestamps of {label}")
        except DataError as e:
            raise DataError(f"{e}; if the frame holds several series, name their column: id_column={ids[0]!r}"
                            if ids else str(e)) from None
        if future is not None:
            y = future.get(sid) if isinstance(future, Mapping) else future
            if y is None:
                raise DataError(f"future has no timestamps for {label}; give every series its own")
            y = to_datetime_index(y, f"the future timestamps of {label}")
        else:
            cal = calendar or TradingCalendar.learn(stamps[rows], name=label, holidays=holidays)
            y = cal.after(stamps[rows][-1], prediction_length, freq, label)
        series.append((sid, rows, y))
    return FrameSeries(candles, stamps, series, id_column, ts_name or "timestamps")
