"""Load a Qlib universe, cut it into train / val / test splits and save them as plain arrays (no pickle).

    python finetune/qlib_data_preprocess.py --config configs/qlib_csi300.yaml [--set data.instrument=csi500]

Steps: check the Qlib folder and the settings (one error listing every problem); read $open, $high, $low, $close,
$volume, $vwap for the universe over the dataset range plus lookback / predict margins (one D.features call);
derive vol = $volume and amt = vol * mean(open, high, low, close) (or vol * $vwap); drop rows with missing values
and instruments too short for one window (both logged by name); split by the configured time ranges; write
train.npz, val.npz, test.npz and manifest.json into data.dataset_path (all files or none).

Split rules (bars are each instrument's own trading days):
    train  bars inside train_time_range: every bar of every training window, targets included, lies in it.
    val    the lookback_window bars before val_time_range, then the bars inside it: the earliest window's first
           forecast bar is the first validation day, and no target bar is a training bar.
    test   the lookback_window bars before test_time_range, the bars inside it, and up to predict_window bars
           after it (only to measure the realised returns of the last forecasts; no forecast is made there).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from finetune.config import QlibConfig, cli_parser, load_qlib_config, parse_range
from finetune.dataset import FORMAT, MANIFEST_NAME, QlibSplit, manifest_settings, save_split, split_path
from finetune.utils.checkpoint import write_json_atomic
from finetune.utils.config_utils import ConfigError, Problems
from model.features import calc_time_stamps

log = logging.getLogger("finetune.qlib")

QLIB_FIELDS = ["$open", "$high", "$low", "$close", "$volume", "$vwap"]


# ----------------------------------------------------------------------------------------------------------------
# checks that need the Qlib folder (before anything is loaded)


def check_qlib_folder(cfg: QlibConfig, problems: Problems, need_benchmark: bool = True) -> None:
    """Record a problem, naming the setting, for a Qlib folder that lacks what the pipeline reads:
    the calendar, the universe's instrument list, and the benchmark's close prices."""
    d = cfg.data
    root = Path(os.path.expanduser(d.qlib_data_path))
    if not root.is_dir():
        problems.add("data.qlib_data_path", f"{root} is not a folder; point it at a Qlib provider folder (with calendars/, instruments/, features/)")
        return
    calendar = root / "calendars" / f"{d.freq}.txt"
    if not calendar.is_file():
        found = sorted(p.stem for p in (root / "calendars").glob("*.txt"))
        problems.add(
            "data.qlib_data_path" if not found else "data.freq",
            f"{calendar} not found (calendars present: {found or 'none'}); is {root} a Qlib provider folder?",
        )
    universe = root / "instruments" / f"{d.instrument}.txt"
    if not universe.is_file():
        known = sorted(p.stem for p in (root / "instruments").glob("*.txt"))
        problems.add("data.instrument", f"unknown universe {d.instrument!r}: {universe} not found (available: {known or 'none'})")
    bench = cfg.benchmark
    if need_benchmark and bench:
        bench_close = root / "features" / bench.lower() / f"close.{d.freq}.bin"
        if not bench_close.is_file():
            problems.add("backtest.benchmark", f"{bench!r} is not in the data ({bench_close} not found); pick an instrument under {root / 'features'}")


def check_ranges_in_calendar(cfg: QlibConfig, calendar: pd.DatetimeIndex, problems: Problems) -> None:
    """Each time range must contain at least one trading day of the Qlib calendar."""
    first, last = calendar[0].date(), calendar[-1].date()
    for name in ("train_time_range", "val_time_range", "test_time_range"):
        if parse_range(getattr(cfg.data, name), f"data.{name}", problems) is None:
            continue
        r = range_bounds(getattr(cfg.data, name))
        days = int(((calendar >= r[0]) & (calendar <= r[1])).sum())
        problems.check(
            days > 0, f"data.{name}",
            f"{[str(x.date()) for x in r]} holds no trading day of the Qlib calendar ({first}..{last}); move it inside the data",
        )


# ----------------------------------------------------------------------------------------------------------------
# pure steps (unit-tested without Qlib)


def load_range(calendar: pd.DatetimeIndex, begin: str, end: str, lookback: int, predict: int) -> tuple[pd.Timestamp, pd.Timestamp]:
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


@dataclass
class FrameReport:
    """What `frame_to_panel` removed, for the log and manifest."""

    nan_rows: dict[str, int] = field(default_factory=dict)
    """Rows dropped per instrument because a feature was missing (suspended days, gaps in the data)."""
    short: dict[str, int] = field(default_factory=dict)
    """Instruments dropped because fewer bars than `min_bars` remained: name -> bars."""


def frame_to_panel(frame: pd.DataFrame, amount_source: str, min_bars: int) -> tuple[QlibSplit, FrameReport]:
    """Qlib's stacked frame (index instrument, datetime; columns $open ... $vwap) -> one contiguous panel.

    One sort and vectorised column arithmetic; instruments become row ranges (offsets), never per-symbol frames.
    Rows with a missing or non-finite feature are dropped (counted per instrument); instruments with fewer than
    `min_bars` bars left are dropped (listed).
    """
    missing = [c for c in QLIB_FIELDS[:5] if c not in frame.columns]
    if missing:
        raise ValueError(f"the Qlib data lacks fields {missing}")
    frame = frame.sort_index(level=["instrument", "datetime"])
    level = frame.index.names.index("instrument")
    inst = np.asarray(frame.index.codes[level], dtype=np.int64)  # (N,) instrument codes: cheap to compare
    level_names = np.asarray(frame.index.levels[level].astype(str))
    when = datetimes_ns(frame.index.get_level_values("datetime"))
    o, h, l, c, vol = (frame[f].to_numpy(np.float64) for f in QLIB_FIELDS[:5])
    if amount_source == "vwap":
        if "$vwap" not in frame.columns:
            raise ValueError("data.amount_source=vwap but the Qlib data has no $vwap field; use ohlc_mean")
        amt = vol * frame["$vwap"].to_numpy(np.float64)
    else:  # the original's amount (and what the forecaster assumes when a series has no amount column)
        amt = vol * (o + h + l + c) / 4.0
    features = np.stack([o, h, l, c, vol, amt], axis=1)  # (N, 6) float64 until the checks are done
    ok = np.isfinite(features).all(axis=1)
    report = FrameReport()
    if not ok.all():
        codes, counts = np.unique(inst[~ok], return_counts=True)
        report.nan_rows = {str(level_names[c]): int(k) for c, k in zip(codes, counts)}
    inst, when, features = inst[ok], when[ok], features[ok]

    # Instrument boundaries: the rows are sorted by instrument, so each one is a contiguous run.
    starts = np.flatnonzero(np.r_[True, inst[1:] != inst[:-1]]) if len(inst) else np.zeros(0, np.int64)
    offsets = np.r_[starts, len(inst)].astype(np.int64)
    names = level_names[inst[starts]]
    lengths = np.diff(offsets)
    keep = lengths >= min_bars
    report.short = {str(n): int(k) for n, k in zip(names[~keep], lengths[~keep])}
    if not keep.all():
        rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in np.flatnonzero(keep)] or [np.zeros(0, np.int64)])
        inst, when, features = inst[rows], when[rows], features[rows]
        offsets = np.r_[0, np.cumsum(lengths[keep])].astype(np.int64)
        names = names[keep]
    stamps = stamps_from_ns(when)
    panel = QlibSplit(features.astype(np.float32), stamps, when, offsets, np.asarray(names, dtype=str))
    return panel, report


def stamps_from_ns(when: np.ndarray) -> np.ndarray:
    """int64 ns datetimes (N,) -> int64 (N, 5): minute, hour, weekday, day, month (the model's time features)."""
    if len(when) == 0:
        return np.zeros((0, 5), dtype=np.int64)
    unique, inverse = np.unique(when, return_inverse=True)  # stamps once per distinct bar time, then gathered
    stamps = calc_time_stamps(pd.DatetimeIndex(unique.astype("datetime64[ns]"))).to_numpy(np.int64)
    return np.ascontiguousarray(stamps[inverse.ravel()], dtype=np.int64)


def range_bounds(time_range: list[str]) -> tuple[pd.Timestamp, pd.Timestamp]:
    """[start, end] dates -> (start 00:00, last nanosecond of end): the end date is inclusive, also for
    intraday bars."""
    start = pd.Timestamp(time_range[0]).as_unit("ns")
    end = pd.Timestamp(time_range[1]).as_unit("ns") + pd.Timedelta(1, "D") - pd.Timedelta(1, "ns")
    return start, end


@dataclass
class SplitRule:
    """How one split is cut from the panel."""

    name: str
    start: pd.Timestamp
    end: pd.Timestamp
    before: int
    """Bars kept before `start` (context of the first windows)."""
    after: int
    """Bars kept after `end` (realised returns of the last forecasts)."""
    min_bars: int
    """An instrument needs at least this many bars from its first kept bar to its last bar inside the range."""


def split_rules(cfg: QlibConfig) -> list[SplitRule]:
    """The three split rules of the module docstring, from the settings."""
    d = cfg.data
    window = d.lookback_window + d.predict_window
    (tr0, tr1), (va0, va1), (te0, te1) = (range_bounds(r) for r in (d.train_time_range, d.val_time_range, d.test_time_range))
    return [
        SplitRule("train", tr0, tr1, before=0, after=0, min_bars=window),
        SplitRule("val", va0, va1, before=d.lookback_window, after=0, min_bars=window),
        # a test forecast at bar t needs lookback bars ending at t
        SplitRule("test", te0, te1, before=d.lookback_window, after=d.predict_window, min_bars=d.lookback_window),
    ]


def cut_split(panel: QlibSplit, rule: SplitRule) -> tuple[QlibSplit, dict[str, int]]:
    """The rows of `panel` that `rule` selects, per instrument; returns (split, dropped: name -> usable bars).

    Instruments without a bar inside the range are simply not part of the split (not in the universe then);
    instruments with bars inside it but too few for `rule.min_bars` are dropped and returned for the log.
    """
    lo_ns, hi_ns = pd.Timestamp(rule.start).value, pd.Timestamp(rule.end).value
    pieces, kept, lengths, dropped = [], [], [], {}
    for s in range(panel.n_instruments):
        first, last = int(panel.offsets[s]), int(panel.offsets[s + 1])
        when = panel.datetimes[first:last]
        a = int(np.searchsorted(when, lo_ns, side="left"))  # first bar inside the range
        b = int(np.searchsorted(when, hi_ns, side="right"))  # one past the last bar inside it
        if b <= a:
            continue
        a0, b1 = max(0, a - rule.before), min(last - first, b + rule.after)
        if b - a0 < rule.min_bars:
            dropped[str(panel.instruments[s])] = b - a0
            continue
        pieces.append(np.arange(first + a0, first + b1))
        kept.append(s)
        lengths.append(b1 - a0)
    rows = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    split = QlibSplit(
        panel.features[rows], panel.stamps[rows], panel.datetimes[rows],
        np.r_[0, np.cumsum(lengths)].astype(np.int64), np.asarray(panel.instruments[kept], dtype=str),
    )
    return split, dropped


def _show(names: dict[str, int], limit: int = 10) -> str:
    items = sorted(names.items())
    text = ", ".join(f"{n} ({k})" for n, k in items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def make_splits(panel: QlibSplit, cfg: QlibConfig) -> tuple[dict[str, QlibSplit], dict[str, Any]]:
    """Cut the three splits; raise one ConfigError naming each time range that leaves its split empty."""
    problems = Problems("The time ranges leave a split empty")
    splits, report = {}, {}
    for rule in split_rules(cfg):
        split, dropped = cut_split(panel, rule)
        key = f"data.{rule.name}_time_range"
        if dropped:
            log.warning("[%s] dropped %d instrument(s) with fewer than %d usable bars: %s",
                        rule.name, len(dropped), rule.min_bars, _show(dropped))
        if split.n_instruments == 0:
            problems.add(
                key,
                f"leaves the {rule.name} split empty: no instrument has {rule.min_bars} bars from "
                f"{rule.before} bars before {rule.start.date()} to {rule.end.date()}"
                + (f" ({len(dropped)} instruments have fewer)" if dropped else "")
                + "; widen the range or shorten data.lookback_window / data.predict_window",
            )
        dates = split.date_range()
        splits[rule.name] = split
        report[rule.name] = {
            "time_range": [str(rule.start.date()), str(rule.end.date())],
            "instruments": split.n_instruments,
            "rows": split.n_rows,
            "first_bar": dates[0] if dates else None,
            "last_bar": dates[1] if dates else None,
            "bars_before_range": rule.before,
            "bars_after_range": rule.after,
            "dropped_too_short": dropped,
        }
        log.info("[%s] %d instruments, %d bars, %s..%s", rule.name, split.n_instruments, split.n_rows,
                 *(dates or ("-", "-")))
    problems.raise_if_any()
    return splits, report


def write_splits(folder: str | Path, splits: dict[str, QlibSplit], manifest: dict[str, Any]) -> Path:
    """Write every split and the manifest, or nothing: files go to a temporary folder first and are moved into
    `folder` only once all of them are written (the manifest last, so its presence means a complete set)."""
    folder = Path(folder).expanduser()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, split in splits.items():
            save_split(split_path(tmp, name), split)
        write_json_atomic(manifest, tmp / MANIFEST_NAME)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST_NAME).unlink(missing_ok=True)  # an interrupted move must not leave an old manifest
        for name in splits:
            os.replace(split_path(tmp, name), split_path(folder, name))
        os.replace(tmp / MANIFEST_NAME, folder / MANIFEST_NAME)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# ----------------------------------------------------------------------------------------------------------------
# Qlib


def init_qlib(cfg: QlibConfig) -> None:
    import qlib

    qlib.init(provider_uri=os.path.expanduser(cfg.data.qlib_data_path), region=cfg.data.region)


def read_calendar(cfg: QlibConfig) -> pd.DatetimeIndex:
    from qlib.data import D

    return pd.DatetimeIndex(D.calendar(freq=cfg.data.freq)).as_unit("ns")


def load_frame(cfg: QlibConfig, start: pd.Timestamp, end: pd.Timestamp) -> pd.DataFrame:
    """One D.features call for the whole universe: index (instrument, datetime), columns QLIB_FIELDS."""
    from qlib.data import D

    universe = D.instruments(cfg.data.instrument)
    fields = QLIB_FIELDS if cfg.data.amount_source == "vwap" else QLIB_FIELDS[:5]
    return D.features(universe, fields, start_time=start, end_time=end, freq=cfg.data.freq)


# ----------------------------------------------------------------------------------------------------------------
# entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli_parser(__doc__)
    return parser.parse_args(argv)


def preprocess(cfg: QlibConfig) -> dict[str, Any]:
    """Run every step for `cfg`; returns the manifest written to data.dataset_path."""
    problems = cfg.problems()
    check_qlib_folder(cfg, problems)
    problems.raise_if_any()

    d = cfg.data
    init_qlib(cfg)
    calendar = read_calendar(cfg)
    problems = Problems()
    check_ranges_in_calendar(cfg, calendar, problems)
    problems.raise_if_any()
    start, end = load_range(calendar, d.dataset_begin_time, d.dataset_end_time, d.lookback_window, d.predict_window)
    log.info("loading %s from %s (%s .. %s, %s bars)", d.instrument, d.qlib_data_path, start.date(), end.date(), d.freq)
    frame = load_frame(cfg, start, end)
    if frame.empty:
        raise ConfigError([f"data.instrument: universe {d.instrument!r} has no data between {start.date()} and {end.date()}"])

    # Fewer bars than one test context cannot serve any split (training windows need lookback + predict).
    panel, frame_report = frame_to_panel(frame, d.amount_source, min_bars=d.lookback_window)
    if frame_report.nan_rows:
        log.warning("dropped %d bar(s) with missing values in %d instrument(s): %s",
                    sum(frame_report.nan_rows.values()), len(frame_report.nan_rows), _show(frame_report.nan_rows))
    if frame_report.short:
        log.warning("dropped %d instrument(s) with fewer than %d bars in the whole range: %s",
                    len(frame_report.short), d.lookback_window, _show(frame_report.short))
    splits, split_report = make_splits(panel, cfg)

    # Trading days from the test range's start to predict_window days past its end: the forecast dates
    # (y timestamps) of the test windows come from here.
    test_rule = split_rules(cfg)[2]
    lo = int(calendar.searchsorted(test_rule.start, side="left"))
    hi = int(calendar.searchsorted(test_rule.end, side="right")) + d.predict_window
    calendar_ns = datetimes_ns(calendar[lo:hi])
    manifest = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": manifest_settings(cfg),
        "load_range": [str(start.date()), str(end.date())],
        "instruments_loaded": int(frame.index.get_level_values("instrument").nunique()),
        "nan_rows_dropped": frame_report.nan_rows,
        "instruments_too_short": frame_report.short,
        "splits": split_report,
        "test_calendar_ns": calendar_ns.tolist(),
    }
    folder = write_splits(d.dataset_path, splits, manifest)
    log.info("wrote %s", ", ".join(p.name for p in sorted(folder.iterdir())))
    return manifest


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    cfg = load_qlib_config(args.config, args.set)
    preprocess(cfg)


if __name__ == "__main__":
    import sys

    from finetune.cli import run_script  # clean errors, exit codes, --debug, --help-config, --print-config

    sys.exit(run_script("qlib-preprocess", main))
