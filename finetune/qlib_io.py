"""Reading a Qlib provider folder (folder checks, qlib.init, calendar, one D.features call) and the conversion of
Qlib's stacked frame into a `SeriesPanel`, for both Qlib entry points; Qlib is imported only inside the functions.
The field mapping: docs/CONTRACTS.md, "File formats: Qlib fields -> model features"."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from finetune.config import QlibConfig, parse_range
from finetune.utils.config_utils import Problems
from finetune.utils.store import SeriesPanel
from finetune.utils.windows import wallclock_stamps
from model.errors import DataError
from model.fileio import read_json_or_empty

# Qlib expressions read for open, high, low, close, volume (+ $vwap when data.amount_source is vwap).
QLIB_FIELDS = ["$open", "$high", "$low", "$close", "$volume", "$vwap"]


# checks that need the Qlib folder (before anything is loaded)

def check_qlib_folder(cfg: QlibConfig, problems: Problems) -> None:
    """Record a problem, naming the setting, for a Qlib folder that lacks what the pipeline reads:
    the calendar, the universe's instrument list, and the benchmark's close prices."""
    d = cfg.data
    root = Path(os.path.expanduser(d.qlib_data_path))
    if not root.is_dir():
        problems.add("data.qlib_data_path", f"{root} is not a folder; point it at a Qlib provider folder (with "
                     "calendars/, instruments/, features/)")
        return
    calendar = root / "calendars" / f"{d.freq}.txt"
    if not calendar.is_file():
        found = sorted(p.stem for p in (root / "calendars").glob("*.txt"))
        problems.add("data.qlib_data_path" if not found else "data.freq",
                     f"{calendar} not found (calendars present: {found or 'none'}); is {root} a Qlib provider folder?")
    universe = root / "instruments" / f"{d.instrument}.txt"
    if not universe.is_file():
        known = sorted(p.stem for p in (root / "instruments").glob("*.txt"))
        problems.add("data.instrument", f"unknown universe {d.instrument!r}: {universe} not found (available: "
                     f"{known or 'none'})")
    bench = cfg.benchmark
    if bench:
        bench_close = root / "features" / bench.lower() / f"close.{d.freq}.bin"
        if not bench_close.is_file():
            problems.add("backtest.benchmark", f"{bench!r} is not in the data ({bench_close} not found); pick an "
                         f"instrument under {root / 'features'}")


def benchmark_label(cfg: QlibConfig) -> str:
    """The benchmark's name, plus what it really is when the store builder wrote a substitute for it (an
    equal-weighted index of the universe; build_info.json in the provider folder says so)."""
    info = Path(os.path.expanduser(cfg.data.qlib_data_path)) / "build_info.json"
    built = read_json_or_empty(info)
    source = str(built.get("benchmark_source", ""))
    same = str(built.get("benchmark", "")).upper() == cfg.benchmark.upper()
    return f"{cfg.benchmark} ({source})" if same and source.startswith("substitute") else cfg.benchmark


def check_ranges_in_calendar(cfg: QlibConfig, calendar: pd.DatetimeIndex, problems: Problems) -> None:
    """Each time range must contain at least one trading day of the Qlib calendar."""
    first, last = calendar[0].date(), calendar[-1].date()
    for name in ("train_time_range", "val_time_range", "test_time_range"):
        if parse_range(getattr(cfg.data, name), f"data.{name}", problems) is None:
            continue
        r = range_bounds(getattr(cfg.data, name))
        days = int(((calendar >= r[0]) & (calendar <= r[1])).sum())
        problems.check(days > 0, f"data.{name}", f"{[str(x.date()) for x in r]} holds no trading day of the Qlib "
                       f"calendar ({first}..{last}); move it inside the data")


# pure conversions (unit-tested without Qlib)

def load_range(calendar: pd.DatetimeIndex, begin: str, end: str, lookback: int, predict: int
               ) -> tuple[pd.Timestamp, pd.Timestamp]:
    """Dates to load: `lookback` trading days before `begin` to `predict` trading days after `end`, clamped to the
    calendar (the margins give the first windows their context and the last forecasts their realised returns)."""
    start_i = int(calendar.searchsorted(pd.Timestamp(begin), side="left"))
    end_i = int(calendar.searchsorted(pd.Timestamp(end), side="right")) - 1  # last trading day <= end
    start_i = max(0, start_i - lookback)
    end_i = min(len(calendar) - 1, max(end_i, 0) + predict)
    return calendar[start_i], calendar[end_i]


def datetimes_ns(values: Any) -> np.ndarray:
    """Datetimes (any pandas resolution) -> int64 nanoseconds since 1970-01-01."""
    return np.asarray(pd.DatetimeIndex(values).as_unit("ns").asi8, dtype=np.int64)


def range_bounds(time_range: list[str]) -> tuple[pd.Timestamp, pd.Timestamp]:
    """[start, end] dates -> (start 00:00, last nanosecond of end): the end date is inclusive, also for
    intraday bars."""
    start = pd.Timestamp(time_range[0]).as_unit("ns")
    end = pd.Timestamp(time_range[1]).as_unit("ns") + pd.Timedelta(1, "D") - pd.Timedelta(1, "ns")
    return start, end


def date_range(panel: SeriesPanel) -> tuple[str, str] | None:
    """(first, last) bar date over all series of a panel with datetimes, ISO strings; None when empty."""
    if panel.n_rows == 0 or panel.datetimes is None:
        return None
    lo, hi = np.datetime64(int(panel.datetimes.min()), "ns"), np.datetime64(int(panel.datetimes.max()), "ns")
    return str(lo.astype("datetime64[D]")), str(hi.astype("datetime64[D]"))


def time_major(panel: SeriesPanel, rows: np.ndarray) -> np.ndarray:
    """Features of the bars `rows` (any int shape R) in time-major order: (*R, F) (a gathered copy)."""
    return np.ascontiguousarray(np.moveaxis(panel.features[:, rows], 0, -1))


@dataclass
class FrameReport:
    """What `frame_to_panel` removed, for the log and manifest."""

    # Rows dropped per instrument because a feature was missing (suspended days, gaps in the data).
    nan_rows: dict[str, int] = field(default_factory=dict)
    # Instruments (or pieces cut at a gap) with fewer than `min_bars` bars, dropped: name -> bars dropped.
    short: dict[str, int] = field(default_factory=dict)
    # Cuts per instrument at gaps of more than max_gap_days missing trading days.
    gaps: dict[str, int] = field(default_factory=dict)


def frame_to_panel(frame: pd.DataFrame, amount_source: str, min_bars: int, calendar: pd.DatetimeIndex | None = None,
                   max_gap_days: int | None = None) -> tuple[SeriesPanel, FrameReport]:
    """Qlib's stacked frame (index instrument, datetime; columns $open ... $vwap) -> one contiguous panel (one sort,
    instruments become column ranges, never per-symbol frames). Rows with a missing or non-finite feature (suspended
    days: NaN in the store) are dropped (counted per instrument). With `calendar` and `max_gap_days`, an instrument is
    cut into separate series wherever more than `max_gap_days` trading days of the calendar are missing between two of
    its bars (a window never joins bars across such a gap). Series with fewer than `min_bars` bars are dropped (listed).
    The panel has datetimes (ns) and names = instrument codes (one code names several series when it was cut)."""
    missing = [c for c in QLIB_FIELDS[:5] if c not in frame.columns]
    if missing:
        raise DataError(f"the Qlib data lacks fields {missing}")
    frame = frame.sort_index(level=["instrument", "datetime"])
    level = frame.index.names.index("instrument")
    inst = np.asarray(frame.index.codes[level], dtype=np.int64)  # (N,) instrument codes: cheap to compare
    level_names = np.asarray(frame.index.levels[level].astype(str))
    when = datetimes_ns(frame.index.get_level_values("datetime"))
    o, h, l, c, volume = (frame[f].to_numpy(np.float64) for f in QLIB_FIELDS[:5])
    if amount_source == "vwap":
        if "$vwap" not in frame.columns:
            raise DataError("data.amount_source=vwap but the Qlib data has no $vwap field; use ohlc_mean")
        amount = volume * frame["$vwap"].to_numpy(np.float64)
    else:  # the original's amount (and what the forecaster assumes when a series has no amount)
        amount = volume * (o + h + l + c) / 4.0
    features = np.stack([o, h, l, c, volume, amount], axis=1)  # (N, 6) float64 in FEATURES order until checked
    ok = np.isfinite(features).all(axis=1)

    def per_instrument(codes: np.ndarray) -> dict[str, int]:  # {instrument: how many of `codes` (N',) are its}
        return {str(level_names[c]): int(k) for c, k in zip(*np.unique(codes, return_counts=True))}

    report = FrameReport(nan_rows=per_instrument(inst[~ok]))
    inst, when, features = inst[ok], when[ok], features[ok]

    # Series boundaries: the rows are sorted by instrument, so each one is a contiguous run; with a calendar, a run
    # is also cut where the calendar position jumps by more than max_gap_days + 1.
    new = np.r_[True, inst[1:] != inst[:-1]] if len(inst) else np.zeros(0, bool)
    if calendar is not None and max_gap_days is not None and len(inst):
        position = np.searchsorted(datetimes_ns(calendar), when)  # (N,) calendar index of each bar
        cut = np.r_[False, (np.diff(position) > max_gap_days + 1) & ~new[1:]]
        report.gaps = per_instrument(inst[cut])
        new = new | cut
    starts = np.flatnonzero(new) if len(inst) else np.zeros(0, np.int64)
    offsets = np.r_[starts, len(inst)].astype(np.int64)
    names = level_names[inst[starts]]
    lengths = np.diff(offsets)
    keep = lengths >= min_bars
    for n, k in zip(names[~keep], lengths[~keep]):
        report.short[str(n)] = report.short.get(str(n), 0) + int(k)
    if not keep.all():
        rows = np.repeat(keep, lengths)  # (N,) bool: the bars of the series kept
        inst, when, features = inst[rows], when[rows], features[rows]
        offsets = np.r_[0, np.cumsum(lengths[keep])].astype(np.int64)
        names = names[keep]
    panel = SeriesPanel(np.ascontiguousarray(features.astype(np.float32).T), wallclock_stamps(when), offsets,
                        np.asarray(names, dtype=str), when)
    return panel, report


def init_qlib(cfg: QlibConfig) -> None:
    """qlib.init on data.qlib_data_path with data.region."""
    import logging

    import qlib

    # No expression / dataset cache: nothing is written outside the provider folder, and no stale cache can answer.
    qlib.init(provider_uri=os.path.expanduser(cfg.data.qlib_data_path), region=cfg.data.region, expression_cache=None,
              dataset_cache=None, logging_level=logging.WARNING,
              **({"kernels": 1} if os.cpu_count() and os.cpu_count() <= 2 else {}))


def read_calendar(cfg: QlibConfig) -> pd.DatetimeIndex:
    """The trading calendar of data.freq (ns resolution)."""
    from qlib.data import D

    return pd.DatetimeIndex(D.calendar(freq=cfg.data.freq)).as_unit("ns")


def universe_spans(cfg: QlibConfig, start: pd.Timestamp, end: pd.Timestamp
                   ) -> dict[str, list[tuple[pd.Timestamp, pd.Timestamp]]]:
    """Membership spells of every instrument of the universe that is a member at some time in [start, end]:
    {code: [(first day, last day), ...]} (Qlib's instruments/<universe>.txt, clipped to the range)."""
    from qlib.data import D

    spans = D.list_instruments(D.instruments(cfg.data.instrument), start_time=start, end_time=end,
                               freq=cfg.data.freq, as_list=False)
    return {str(k): [(pd.Timestamp(a), pd.Timestamp(b)) for a, b in v] for k, v in sorted(spans.items())}


def load_frame(cfg: QlibConfig, start: pd.Timestamp, end: pd.Timestamp, instruments: list[str] | None = None
               ) -> pd.DataFrame:
    """One D.features call: index (instrument, datetime), columns QLIB_FIELDS.

    `instruments` (a list of codes) are loaded WITHOUT the universe's membership mask, i.e. their whole history in
    [start, end] (Qlib's `D.instruments(universe)` would hide every bar outside the membership spells and let the
    rest be joined end to end); None = the universe as Qlib masks it."""
    from qlib.data import D

    universe = list(instruments) if instruments is not None else D.instruments(cfg.data.instrument)
    fields = QLIB_FIELDS if cfg.data.amount_source == "vwap" else QLIB_FIELDS[:5]
    return D.features(universe, fields, start_time=start, end_time=end, freq=cfg.data.freq)


def membership_mask(panel: SeriesPanel, spans: dict[str, list[tuple[pd.Timestamp, pd.Timestamp]]]) -> np.ndarray:
    """(N,) bool: whether each bar's instrument is a member of the universe on that bar's day (spells inclusive)."""
    member = np.zeros(panel.n_rows, dtype=bool)
    day_ns = 86_400_000_000_000
    for s, name in enumerate(panel.names):
        rows = panel.rows(s)
        when = np.asarray(panel.datetimes[rows])
        for a, b in spans.get(str(name), []):
            lo, hi = pd.Timestamp(a).normalize().value, pd.Timestamp(b).normalize().value + day_ns
            member[rows] |= (when >= lo) & (when < hi)
    return member
