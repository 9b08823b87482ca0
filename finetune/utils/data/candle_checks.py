"""Checks on raw candle files before they become a `SeriesPanel`: timestamps, time zones, bar frequency, float32 range.

Pure functions on pandas/numpy values, used by the CSV loader and the data store; each error is a `CandleDataError`
(a ValueError) naming the file, the line and the setting (or the data) to change.

The timestamp rule: the model's time features (minute, hour, weekday, day, month) describe the exchange's LOCAL
wall-clock time, the time a trader sees on the exchange's clock.
- Stamps that carry a UTC offset (`2024-03-08 09:30:00-05:00`, `...Z`) are converted to `data.timezone` when it is
  set (an IANA name such as "America/New_York"), so a DST change inside one file (-05:00 then -04:00) still gives
  09:30 every morning. Without `data.timezone` each value keeps the wall-clock time it states: it is parsed in its
  own offset and the offset is then dropped (pandas refuses mixed offsets otherwise, or shifts everything to UTC).
- Stamps without an offset are taken as the local wall-clock time already (also when `data.timezone` is set).
- Within one file all stamps carry an offset or none does; across files the same (`check_tz_consistency`), since a
  naive and an offset-carrying file cannot be placed on one clock.
- Converting to a zone with DST repeats one wall-clock hour per year (the autumn change); exchanges are closed then.

The frequency rule: a file's bar length is the median spacing of its sorted stamps (`infer_frequency`), which
ignores overnight, weekend and holiday gaps. Files of different bar lengths in one data set are warned about;
when `data.frequency` is set, a file of another length is an error.

The range rule: the model computes in float32, so a value beyond float32's finite range (|x| > 3.4028235e38, e.g.
1e39, or inf) would become inf after loading; it is an error naming file, column and line.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "FLOAT32_MAX",
    "CandleDataError",
    "Float32RangeError",
    "FrequencyError",
    "MixedFrequencyWarning",
    "TimestampError",
    "TimezoneMixError",
    "check_float32_range",
    "check_frequencies",
    "check_tz_consistency",
    "format_frequency",
    "frequency_problem",
    "timezone_problem",
    "has_utc_offset",
    "infer_frequency",
    "parse_timestamps",
]

FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4028235e+38
# A UTC offset (or Z) right after a clock time: "09:30-05:00", "09:30:00.5+0530", "09:30Z". The clock time must
# precede it so a plain date's "-02" (2024-01-02) is not read as an offset.
_OFFSET_RE = r"\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?\s*(?P<off>Z|UTC|[+-]\d{2}(?::?\d{2})?)$"
_SHOW = 5  # how many lines / files an error lists


class CandleDataError(ValueError):
    """A problem in the candle data itself; the message names the file, line and what to change."""


class TimestampError(CandleDataError):
    """A timestamp that cannot be read, or a file mixing stamps with and without a UTC offset."""


class TimezoneMixError(CandleDataError):
    """Files with UTC offsets and files without them in one data set."""


class FrequencyError(CandleDataError):
    """A file whose bar length differs from `data.frequency` (or that has too few stamps to tell)."""


class Float32RangeError(CandleDataError):
    """A value outside float32's finite range."""


class MixedFrequencyWarning(UserWarning):
    """Files of different bar lengths in one data set while `data.frequency` is not set."""


def _lines(positions: Sequence[int], first_row: int) -> str:
    shown = ", ".join(str(first_row + int(p)) for p in positions[:_SHOW])
    return shown + (f" (+{len(positions) - _SHOW} more)" if len(positions) > _SHOW else "")


def _offset_text(values: pd.Series) -> pd.Series:
    """The UTC-offset suffix of each string (NaN where there is none)."""
    return values.str.extract(_OFFSET_RE, expand=True)["off"]


def has_utc_offset(values: Any) -> bool:
    """True when the timestamps carry a UTC offset (tz-aware datetimes, or strings ending in +hh:mm / Z)."""
    s = pd.Series(values)
    if isinstance(s.dtype, pd.DatetimeTZDtype):
        return True
    if pd.api.types.is_datetime64_dtype(s.dtype) or len(s) == 0:
        return False
    return bool(_offset_text(s.astype("string").str.strip()).notna().any())


def _offsets_as_timedelta(off: pd.Series) -> pd.Series:
    """'+05:30' / '-0400' / '+03' / 'Z' -> Timedelta per row."""
    norm = off.str.replace(":", "", regex=False).replace({"Z": "+0000", "UTC": "+0000"})
    sign = norm.str[0].map({"+": 1, "-": -1}).astype("int64")
    hours = norm.str[1:3].astype("int64")
    minutes = norm.str[3:5].replace("", "0").fillna("0").astype("int64")
    return pd.to_timedelta(sign * (hours * 60 + minutes), unit="min")


def parse_timestamps(values: Any, *, source: str, fmt: str | None = None, timezone: str | None = None,
                     first_row: int = 1) -> pd.DatetimeIndex:
    """Read one file's timestamps as naive local wall-clock times (the rule in the module docstring).

    Parameters
    ----------
    values: (N,) strings, datetimes (naive or tz-aware) or a pandas Series/Index of them.
    source: the file (or series) name, for messages.
    fmt: a strftime format (`data.timestamp_format`); None lets pandas infer it.
    timezone: the exchange's IANA zone (`data.timezone`); offset-carrying stamps are converted to it.
    first_row: the file line of values[0] (2 for a CSV with a header line), for messages.

    Returns
    -------
    (N,) naive `DatetimeIndex`, unit ns, in the input order.
    """
    s = pd.Series(values).reset_index(drop=True)
    if isinstance(s.dtype, pd.DatetimeTZDtype) or pd.api.types.is_datetime64_dtype(s.dtype):
        parsed = s
    else:
        text = s.astype("string").str.strip()
        missing = np.flatnonzero((text.isna() | (text == "")).to_numpy())
        if len(missing):
            raise TimestampError(f"{source}: empty timestamp at line(s) {_lines(missing, first_row)}; every candle "
                                 "needs a time (fix the file)")
        off = _offset_text(text)
        aware = off.notna().to_numpy()
        if aware.any() and not aware.all():
            with_, without = np.flatnonzero(aware), np.flatnonzero(~aware)
            raise TimestampError(
                f"{source}: some timestamps carry a UTC offset (line(s) {_lines(with_, first_row)}, e.g. "
                f"'{text[with_[0]]}') and some do not (line(s) {_lines(without, first_row)}, e.g. "
                f"'{text[without[0]]}'); write all of them with an offset or none")
        parsed = pd.to_datetime(text, format=fmt, errors="coerce", utc=bool(aware.any()))
        bad = np.flatnonzero(parsed.isna().to_numpy())
        if len(bad):
            how = f"format '{fmt}'" if fmt else "an inferred format"
            raise TimestampError(
                f"{source}: cannot read timestamp(s) at line(s) {_lines(bad, first_row)}, e.g. '{text[bad[0]]}' "
                f"(with {how}); set data.timestamp_format to the strftime format of the file, "
                "e.g. '%Y-%m-%d %H:%M:%S%z'")
        if aware.any() and timezone is None:
            # UTC instant + the offset each value stated = the wall-clock time it stated.
            parsed = parsed.dt.tz_localize(None) + _offsets_as_timedelta(off).to_numpy()
    if isinstance(parsed.dtype, pd.DatetimeTZDtype):
        if timezone is not None:
            try:
                parsed = parsed.dt.tz_convert(timezone)
            except Exception as e:  # pytz/zoneinfo raise different types for an unknown zone
                raise TimestampError(f"data.timezone: unknown time zone '{timezone}' ({e}); use an IANA name such "
                                     "as 'America/New_York' or 'Asia/Shanghai'") from e
        parsed = parsed.dt.tz_localize(None)
    return pd.DatetimeIndex(parsed).as_unit("ns")


def check_tz_consistency(aware: Mapping[str, bool]) -> None:
    """Raise `TimezoneMixError` when some files carry UTC offsets and others do not.

    Parameters
    ----------
    aware: {file name: whether its stamps carry an offset} (see `has_utc_offset`).
    """
    with_ = [f for f, a in aware.items() if a]
    without = [f for f, a in aware.items() if not a]
    if with_ and without:
        def show(files: list[str]) -> str:
            return ", ".join(files[:_SHOW]) + (f" (+{len(files) - _SHOW} more)" if len(files) > _SHOW else "")

        raise TimezoneMixError(
            f"data: {len(with_)} file(s) have timestamps with a UTC offset ({show(with_)}) and {len(without)} "
            f"without ({show(without)}); they cannot be put on one clock. Write all files with offsets (and set "
            "data.timezone to the exchange's zone) or all in the exchange's local time without offsets")


def infer_frequency(index: Any, *, source: str = "data") -> pd.Timedelta:
    """The bar length of one file: the median spacing of its sorted, distinct stamps (robust to session gaps).

    Parameters
    ----------
    index: (N,) timestamps (DatetimeIndex, Series or array of datetime64).
    source: the file name, for the error.

    Returns
    -------
    The median positive spacing as a `pd.Timedelta`. Raises `FrequencyError` with fewer than two distinct stamps.
    """
    stamps = np.unique(pd.DatetimeIndex(index).as_unit("ns").asi8)  # sorted, distinct, int64 ns
    if len(stamps) < 2:
        raise FrequencyError(f"{source}: needs at least two distinct timestamps to tell the bar length, has "
                             f"{len(stamps)}; add data or set data.frequency")
    return pd.Timedelta(int(np.median(np.diff(stamps))), unit="ns")


def format_frequency(td: pd.Timedelta) -> str:
    """A bar length as people write it: '5min', '1h', '1 day', '30s'."""
    td = pd.Timedelta(td)
    day, hour, minute, second = (pd.Timedelta(1, u) for u in ("D", "h", "min", "s"))
    if td % day == pd.Timedelta(0) and td >= day:
        n = td // day
        return f"{n} day" + ("s" if n != 1 else "")
    for unit, name in ((hour, "h"), (minute, "min"), (second, "s")):
        if td % unit == pd.Timedelta(0) and td >= unit:
            return f"{td // unit}{name}"
    return str(td)


def _parse_expected(expected: str | pd.Timedelta) -> pd.Timedelta:
    if isinstance(expected, pd.Timedelta):
        return expected
    try:
        td = pd.Timedelta(str(expected).strip())
    except ValueError as e:
        raise FrequencyError(f"data.frequency: cannot read '{expected}' as a bar length; use e.g. 5min, 1h, "
                             "1D") from e
    if td <= pd.Timedelta(0):
        raise FrequencyError(f"data.frequency: must be a positive bar length, got '{expected}'")
    return td


def check_frequencies(freqs: Mapping[str, pd.Timedelta], expected: str | pd.Timedelta | None = None
                      ) -> pd.Timedelta | None:
    """Compare the files' bar lengths: a warning naming the odd files, an error when `data.frequency` is set.

    Parameters
    ----------
    freqs: {file name: its `infer_frequency`}.
    expected: `data.frequency` ("5min", "1h", "1D" or a Timedelta), or None.

    Returns
    -------
    The data set's bar length: `expected`, else the most common one (None for no files).
    Warns `MixedFrequencyWarning` (expected None) or raises `FrequencyError` (expected set) for odd files.
    """
    if expected is not None:
        want = _parse_expected(expected)
        odd = {f: td for f, td in freqs.items() if pd.Timedelta(td) != want}
        if odd:
            listed = ", ".join(f"{f} ({format_frequency(td)})" for f, td in list(odd.items())[:_SHOW])
            more = f" (+{len(odd) - _SHOW} more)" if len(odd) > _SHOW else ""
            raise FrequencyError(
                f"data.frequency is {format_frequency(want)} but {len(odd)} file(s) have another bar length: "
                f"{listed}{more}; remove or resample them, or change data.frequency")
        return want
    if not freqs:
        return None
    counts = Counter(pd.Timedelta(td) for td in freqs.values())
    common = max(counts, key=lambda td: (counts[td], -td.value))  # most files; ties: the shorter bar
    if len(counts) > 1:
        groups = []
        for td in sorted(counts, key=lambda t: t.value):
            if td == common:
                continue
            files = [f for f, t in freqs.items() if pd.Timedelta(t) == td]
            groups.append(f"{format_frequency(td)}: " + ", ".join(files[:_SHOW])
                          + (f" (+{len(files) - _SHOW} more)" if len(files) > _SHOW else ""))
        warnings.warn(
            f"data: files of different bar lengths are mixed; most are {format_frequency(common)} "
            f"({counts[common]} file(s)), the others: {'; '.join(groups)}. Set data.frequency to make this an "
            "error, or remove/resample the odd files", MixedFrequencyWarning, stacklevel=2)
    return common


def check_float32_range(array: Any, columns: Sequence[str], source: str, first_row: int = 1) -> None:
    """Raise `Float32RangeError` at the first value (row-major) with |x| > float32's max (inf included; NaN not).

    Parameters
    ----------
    array: (N, C) numbers (or (N,) for one column), any numeric dtype.
    columns: the C column names.
    source: the file name.
    first_row: the file line of row 0 (2 for a CSV with a header line).
    """
    a = np.asarray(array)
    if a.ndim == 1:
        a = a.reshape(-1, 1)  # (N, 1)
    if a.dtype.kind in "iub" or a.size == 0:
        return  # integers up to int64/uint64 are far below 3.4e38
    a = a.astype(np.float64, copy=False)
    with np.errstate(invalid="ignore"):
        bad = np.abs(a) > FLOAT32_MAX  # (N, C) bool; NaN compares False
    if not bad.any():
        return
    row = int(np.argmax(bad.any(axis=1)))
    col = int(np.argmax(bad[row]))
    total = int(bad.sum())
    more = f" ({total} such values in this file)" if total > 1 else ""
    name = columns[col] if col < len(columns) else f"#{col}"
    raise Float32RangeError(
        f"{source} line {first_row + row}, column '{name}': value {a[row, col]:.6g} is outside float32's finite "
        f"range (+-{FLOAT32_MAX:.7g}){more}; the model computes in float32, so correct or remove it in the file "
        "(or rescale that column)")


def timezone_problem(name: str | None) -> str | None:
    """Why `data.timezone` is unusable (None when it is unset or a known IANA zone)."""
    if name is None:
        return None
    try:
        pd.Timestamp(0, tz="UTC").tz_convert(name)
    except Exception as e:  # pytz/zoneinfo raise different types for an unknown zone
        return f"unknown time zone '{name}' ({type(e).__name__}); use an IANA name such as 'America/New_York'"
    return None


def frequency_problem(value: str | None) -> str | None:
    """Why `data.frequency` is unusable (None when it is unset or a positive bar length such as '5min')."""
    if value is None:
        return None
    try:
        _parse_expected(value)
    except FrequencyError as e:
        return str(e).removeprefix("data.frequency: ")
    return None
