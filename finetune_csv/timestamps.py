"""Times of the candles: text or datetime stamps -> local wall-clock nanoseconds, zones, bar lengths, and the
errors of the candle data (`CandleDataError` and its kinds) that every data check raises. The zone and bar-length
rules: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import warnings as warnings_module
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from model.errors import DataError

# A UTC offset (or Z) right after a clock time: "09:30-05:00", "09:30:00.5+0530", "09:30Z". The clock time must
# precede it so a plain date's "-02" (2024-01-02) is not read as an offset.
OFFSET_RE = r"\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?\s*(?P<off>Z|UTC|[+-]\d{2}(?::?\d{2})?)$"
SHOWN = 5  # how many lines / rows / files an error lists


class CandleDataError(DataError):
    """A problem in the candle data itself; the message names the file, line and what to change."""


class FrequencyError(CandleDataError):
    """A file whose bar length differs from `data.frequency` (or that has too few stamps to tell)."""


class TimestampError(CandleDataError):
    """A timestamp that cannot be read, or a file mixing stamps with and without a UTC offset."""


class TimezoneMixError(CandleDataError):
    """Files with UTC offsets and files without them in one data set."""


class MixedFrequencyWarning(UserWarning):
    """Files of different bar lengths in one data set while `data.frequency` is not set."""


def listed(items: Sequence) -> str:
    """The first `SHOWN` items (lines, rows or files) comma-separated, and how many more there are."""
    shown = ", ".join(str(v) for v in items[:SHOWN])
    return shown + (f" (+{len(items) - SHOWN} more)" if len(items) > SHOWN else "")


def _offsets_as_timedelta(off: pd.Series) -> pd.Series:
    """'+05:30' / '-0400' / '+03' / 'Z' -> Timedelta per row."""
    norm = off.str.replace(":", "", regex=False).replace({"Z": "+0000", "UTC": "+0000"})
    sign = norm.str[0].map({"+": 1, "-": -1}).astype("int64")
    hours = norm.str[1:3].astype("int64")
    minutes = norm.str[3:5].replace("", "0").fillna("0").astype("int64")
    return pd.to_timedelta(sign * (hours * 60 + minutes), unit="min")


def parse_timestamps(values: Any, *, source: str, fmt: str | None = None, timezone: str | None = None,
                     first_row: int = 1) -> pd.DatetimeIndex:
    """One file's `values (N,)` (text or datetimes, naive or aware) as an (N,) naive ns DatetimeIndex of local
    wall-clock times (the rule: docs/architecture.md); `first_row` is the file line of values[0]."""
    s = pd.Series(values).reset_index(drop=True)
    if isinstance(s.dtype, pd.DatetimeTZDtype) or pd.api.types.is_datetime64_dtype(s.dtype):
        parsed = s
    else:
        text = s.astype("string").str.strip()
        missing = np.flatnonzero((text.isna() | (text == "")).to_numpy())
        if len(missing):
            raise TimestampError(f"{source}: empty timestamp at line(s) {listed(first_row + missing)}; every candle "
                                 "needs a time (fix the file)")
        off = text.str.extract(OFFSET_RE, expand=True)["off"]  # the UTC-offset suffix, NaN where none
        aware = off.notna().to_numpy()
        if aware.any() and not aware.all():
            with_, without = np.flatnonzero(aware), np.flatnonzero(~aware)
            raise TimestampError(
                f"{source}: some timestamps carry a UTC offset (line(s) {listed(first_row + with_)}, e.g. "
                f"'{text[with_[0]]}') and some do not (line(s) {listed(first_row + without)}, e.g. "
                f"'{text[without[0]]}'); write all of them with an offset or none")
        parsed = pd.to_datetime(text, format=fmt, errors="coerce", utc=bool(aware.any()))
        bad = np.flatnonzero(parsed.isna().to_numpy())
        if len(bad):
            how = f"format '{fmt}'" if fmt else "an inferred format"
            raise TimestampError(
                f"{source}: cannot read timestamp(s) at line(s) {listed(first_row + bad)}, e.g. '{text[bad[0]]}' "
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
    """Raise `TimezoneMixError` when some files carry UTC offsets and others do not (`aware`: file -> bool)."""
    with_ = [f for f, a in aware.items() if a]
    without = [f for f, a in aware.items() if not a]
    if with_ and without:
        raise TimezoneMixError(
            f"data: {len(with_)} file(s) have timestamps with a UTC offset ({listed(with_)}) and {len(without)} "
            f"without ({listed(without)}); they cannot be put on one clock. Write all files with offsets (and set "
            "data.timezone to the exchange's zone) or all in the exchange's local time without offsets")


def infer_frequency(index: Any, *, source: str = "data") -> pd.Timedelta:
    """The bar length of one file's `index (N,)`: the median spacing of its sorted, distinct stamps (robust to
    session gaps). FrequencyError with fewer than two distinct stamps."""
    stamps = np.unique(pd.DatetimeIndex(index).as_unit("ns").asi8)  # sorted, distinct, int64 ns
    if len(stamps) < 2:
        raise FrequencyError(f"{source}: needs at least two distinct timestamps to tell the bar length, has "
                             f"{len(stamps)}; add data or set data.frequency")
    return pd.Timedelta(int(np.median(np.diff(stamps))), unit="ns")


def format_frequency(td: pd.Timedelta) -> str:
    """A bar length as people write it: '5min', '1h', '1 day', '30s'."""
    td = pd.Timedelta(td)
    for unit, name in (("D", " day"), ("h", "h"), ("min", "min"), ("s", "s")):
        if td % pd.Timedelta(1, unit) == pd.Timedelta(0) and td >= pd.Timedelta(1, unit):
            n = td // pd.Timedelta(1, unit)
            return f"{n}{name}" + ("s" if unit == "D" and n != 1 else "")
    return str(td)


def parse_frequency(expected: str | pd.Timedelta) -> pd.Timedelta:
    """`data.frequency` (e.g. '5min', '1h', '1D') as a positive Timedelta; FrequencyError otherwise."""
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
    """The data set's bar length from {file: `infer_frequency`}: `expected` (data.frequency), else the most common
    one (None for no files). Odd files: FrequencyError when `expected` is set, else a MixedFrequencyWarning."""
    if expected is not None:
        want = parse_frequency(expected)
        odd = {f: td for f, td in freqs.items() if pd.Timedelta(td) != want}
        if odd:
            shown = listed([f"{f} ({format_frequency(td)})" for f, td in odd.items()])
            raise FrequencyError(
                f"data.frequency is {format_frequency(want)} but {len(odd)} file(s) have another bar length: "
                f"{shown}; remove or resample them, or change data.frequency")
        return want
    if not freqs:
        return None
    counts = Counter(pd.Timedelta(td) for td in freqs.values())
    common = max(counts, key=lambda td: (counts[td], -td.value))  # most files; ties: the shorter bar
    if len(counts) > 1:
        groups = [f"{format_frequency(td)}: {listed([f for f, t in freqs.items() if pd.Timedelta(t) == td])}"
                  for td in sorted(counts, key=lambda t: t.value) if td != common]
        warnings_module.warn(
            f"data: files of different bar lengths are mixed; most are {format_frequency(common)} "
            f"({counts[common]} file(s)), the others: {'; '.join(groups)}. Set data.frequency to make this an "
            "error, or remove/resample the odd files", MixedFrequencyWarning, stacklevel=2)
    return common


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
        parse_frequency(value)
    except FrequencyError as e:
        return str(e).removeprefix("data.frequency: ")
    return None
