"""Load a Qlib universe, cut it into train / val / test splits and save them as plain arrays (no pickle).

    python finetune/qlib_data_preprocess.py --config configs/qlib_csi300.yaml [--set data.instrument=csi500]

Steps: check the Qlib folder and the settings (one error listing every problem); read $open, $high, $low, $close,
$volume, $vwap for the universe over the dataset range plus lookback / predict margins (one D.features call);
derive vol = $volume and amt = vol * mean(open, high, low, close) (or vol * $vwap); drop rows with missing values
and instruments too short for one window (both logged by name); split by the configured time ranges; write
train.npz, val.npz, test.npz and manifest.json into data.dataset_path (all files or none).

Split rules (bars are each instrument's own trading days):
    train  bars inside train_time_range: every bar of every training window, targets included, lies in it.
    val    the lookback bars before val_time_range, then the bars inside it: the earliest window's first
           forecast bar is the first validation day, and no target bar is a training bar.
    test   the lookback bars before test_time_range, the bars inside it, and up to predict bars
           after it (only to measure the realised returns of the last forecasts; no forecast is made there).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from finetune.config import QlibConfig, cli_parser, load
from finetune.dataset import (
    FORMAT,
    MANIFEST_NAME,
    manifest_settings,
    save_split,
    split_path,
)
from finetune.qlib_io import (
    check_qlib_folder,
    check_ranges_in_calendar,
    date_range,
    datetimes_ns,
    frame_to_panel,
    init_qlib,
    load_frame,
    load_range,
    range_bounds,
    read_calendar,
)
from finetune.utils.checkpoint import write_json_atomic
from finetune.utils.config_utils import ConfigError, Problems
from finetune.utils.panel import SeriesPanel

log = logging.getLogger("finetune.qlib")


# ----------------------------------------------------------------------------------------------------------------
# pure steps (unit-tested without Qlib)


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
    window = d.lookback + d.predict
    (tr0, tr1), (va0, va1), (te0, te1) = (range_bounds(r) for r in (d.train_time_range, d.val_time_range, d.test_time_range))
    return [
        SplitRule("train", tr0, tr1, before=0, after=0, min_bars=window),
        SplitRule("val", va0, va1, before=d.lookback, after=0, min_bars=window),
        # a test forecast at bar t needs lookback bars ending at t
        SplitRule("test", te0, te1, before=d.lookback, after=d.predict, min_bars=d.lookback),
    ]


def cut_split(panel: SeriesPanel, rule: SplitRule) -> tuple[SeriesPanel, dict[str, int]]:
    """The bars of `panel` that `rule` selects, per instrument; returns (split, dropped: name -> usable bars).

    Instruments without a bar inside the range are simply not part of the split (not in the universe then);
    instruments with bars inside it but too few for `rule.min_bars` are dropped and returned for the log.
    """
    lo_ns, hi_ns = pd.Timestamp(rule.start).value, pd.Timestamp(rule.end).value
    pieces, kept, lengths, dropped = [], [], [], {}
    for s in range(panel.n_series):
        first, last = int(panel.offsets[s]), int(panel.offsets[s + 1])
        when = panel.datetimes[first:last]
        a = int(np.searchsorted(when, lo_ns, side="left"))  # first bar inside the range
        b = int(np.searchsorted(when, hi_ns, side="right"))  # one past the last bar inside it
        if b <= a:
            continue
        a0, b1 = max(0, a - rule.before), min(last - first, b + rule.after)
        if b - a0 < rule.min_bars:
            dropped[str(panel.names[s])] = b - a0
            continue
        pieces.append(np.arange(first + a0, first + b1))
        kept.append(s)
        lengths.append(b1 - a0)
    rows = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    split = SeriesPanel(
        np.ascontiguousarray(panel.features[:, rows]), panel.stamps[rows], np.r_[0, np.cumsum(lengths)].astype(np.int64),
        np.asarray(panel.names, dtype=str)[kept], panel.datetimes[rows],
    )
    return split, dropped


def _show(names: dict[str, int], limit: int = 10) -> str:
    items = sorted(names.items())
    text = ", ".join(f"{n} ({k})" for n, k in items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def make_splits(panel: SeriesPanel, cfg: QlibConfig) -> tuple[dict[str, SeriesPanel], dict[str, Any]]:
    """Cut the three splits; raise one ConfigError naming each time range that leaves its split empty."""
    problems = Problems("The time ranges leave a split empty")
    splits, report = {}, {}
    for rule in split_rules(cfg):
        split, dropped = cut_split(panel, rule)
        key = f"data.{rule.name}_time_range"
        if dropped:
            log.warning("[%s] dropped %d instrument(s) with fewer than %d usable bars: %s",
                        rule.name, len(dropped), rule.min_bars, _show(dropped))
        if split.n_series == 0:
            problems.add(
                key,
                f"leaves the {rule.name} split empty: no instrument has {rule.min_bars} bars from "
                f"{rule.before} bars before {rule.start.date()} to {rule.end.date()}"
                + (f" ({len(dropped)} instruments have fewer)" if dropped else "")
                + "; widen the range or shorten data.lookback / data.predict",
            )
        dates = date_range(split)
        splits[rule.name] = split
        report[rule.name] = {
            "time_range": [str(rule.start.date()), str(rule.end.date())],
            "instruments": split.n_series,
            "rows": split.n_rows,
            "first_bar": dates[0] if dates else None,
            "last_bar": dates[1] if dates else None,
            "bars_before_range": rule.before,
            "bars_after_range": rule.after,
            "dropped_too_short": dropped,
        }
        log.info("[%s] %d instruments, %d bars, %s..%s", rule.name, split.n_series, split.n_rows,
                 *(dates or ("-", "-")))
    problems.raise_if_any()
    return splits, report


def write_splits(folder: str | Path, splits: dict[str, SeriesPanel], manifest: dict[str, Any]) -> Path:
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
    start, end = load_range(calendar, d.dataset_begin_time, d.dataset_end_time, d.lookback, d.predict)
    log.info("loading %s from %s (%s .. %s, %s bars)", d.instrument, d.qlib_data_path, start.date(), end.date(), d.freq)
    frame = load_frame(cfg, start, end)
    if frame.empty:
        raise ConfigError([f"data.instrument: universe {d.instrument!r} has no data between {start.date()} and {end.date()}"])

    # Fewer bars than one test context cannot serve any split (training windows need lookback + predict).
    panel, frame_report = frame_to_panel(frame, d.amount_source, min_bars=d.lookback)
    if frame_report.nan_rows:
        log.warning("dropped %d bar(s) with missing values in %d instrument(s): %s",
                    sum(frame_report.nan_rows.values()), len(frame_report.nan_rows), _show(frame_report.nan_rows))
    if frame_report.short:
        log.warning("dropped %d instrument(s) with fewer than %d bars in the whole range: %s",
                    len(frame_report.short), d.lookback, _show(frame_report.short))
    splits, split_report = make_splits(panel, cfg)

    # Trading days from the test range's start to predict days past its end: the forecast dates
    # (y timestamps) of the test windows come from here.
    test_rule = split_rules(cfg)[2]
    lo = int(calendar.searchsorted(test_rule.start, side="left"))
    hi = int(calendar.searchsorted(test_rule.end, side="right")) + d.predict
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
    cfg = load(args.config, args.set)
    preprocess(cfg)


if __name__ == "__main__":
    import sys

    from finetune.cli import run_script  # clean errors, exit codes, --debug, --help-config, --print-config

    sys.exit(run_script("qlib-preprocess", main))
