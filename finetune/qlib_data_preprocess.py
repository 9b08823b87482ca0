"""Load a Qlib universe, cut it into train / val / test splits and save them as memory-mappable stores.

    python finetune/qlib_data_preprocess.py --config configs/qlib_csi300.yaml [--set data.instrument=csi500]

The steps and the split rules: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

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
from finetune.dataset import FORMAT, MANIFEST_NAME, content_sha256, manifest_settings, save_split, split_path
from finetune.qlib_io import (
    check_qlib_folder,
    check_ranges_in_calendar,
    date_range,
    datetimes_ns,
    frame_to_panel,
    init_qlib,
    load_frame,
    load_range,
    membership_mask,
    range_bounds,
    read_calendar,
    universe_spans,
)
from finetune.utils.cli_args import parse_config_args
from finetune.utils.config_utils import Problems
from finetune.utils.errors import require_extra, setup_logging
from finetune.utils.store import SeriesPanel
from model.errors import ConfigError
from model.fileio import write_json

log = logging.getLogger("finetune.qlib")


# pure steps (unit-tested without Qlib)

@dataclass
class SplitRule:
    """How one split is cut from the panel."""

    name: str
    start: pd.Timestamp
    end: pd.Timestamp
    before: int  # Context bars kept before each run of target bars.
    context_in_range: bool  # Context bars must lie in [start, end] too (train).
    min_bars: int  # A piece needs at least this many bars from its first context bar to its last target bar.


def split_rules(cfg: QlibConfig, calendar: pd.DatetimeIndex | None = None) -> list[SplitRule]:
    """The three split rules (docs/architecture.md), from the settings; with `calendar`, the test targets start
    on the last trading day before test_time_range (else on its first day)."""
    d = cfg.data
    (tr0, tr1), (va0, va1), (te0, te1) = (range_bounds(r) for r in (d.train_time_range, d.val_time_range,
                                                                     d.test_time_range))
    if calendar is not None:
        te0 = first_signal_day(calendar, te0)
    return [
        SplitRule("train", tr0, tr1, before=d.lookback, context_in_range=True, min_bars=d.window.size),
        SplitRule("val", va0, va1, before=d.lookback, context_in_range=False, min_bars=d.window.size),
        # a test forecast at bar t needs lookback bars ending at t
        SplitRule("test", te0, te1, before=d.lookback - 1, context_in_range=False, min_bars=d.lookback),
    ]


def first_signal_day(calendar: pd.DatetimeIndex, test_start: pd.Timestamp) -> pd.Timestamp:
    """The last trading day before `test_start` (its score trades on the first test day); `test_start` itself when
    the calendar has no earlier day."""
    before = calendar[calendar < test_start]
    return pd.Timestamp(before[-1]) if len(before) else test_start


def cut_split(panel: SeriesPanel, rule: SplitRule, member: np.ndarray | None = None
              ) -> tuple[SeriesPanel, dict[str, int]]:
    """The pieces of `panel` that `rule` selects; returns (split, dropped: name -> usable bars of dropped pieces).

    Target bars: inside [rule.start, rule.end] and, with `member` ((N,) bool), members of the universe. Each run of
    consecutive target bars of a series becomes one piece with up to `rule.before` context bars before it (never
    before the series' first bar, nor, with `context_in_range`, before rule.start). Instruments without a target
    bar are simply not part of the split; pieces shorter than `rule.min_bars` are dropped and returned for the log."""
    lo_ns, hi_ns = pd.Timestamp(rule.start).value, pd.Timestamp(rule.end).value
    pieces, kept, lengths, dropped = [], [], [], {}
    for s in range(panel.n_series):
        first, last = int(panel.offsets[s]), int(panel.offsets[s + 1])
        when = np.asarray(panel.datetimes[first:last])
        in_range = (when >= lo_ns) & (when <= hi_ns)
        target = in_range & (np.asarray(member[first:last]) if member is not None else True)
        floor = int(np.argmax(in_range)) if rule.context_in_range and in_range.any() else 0
        edges = np.diff(np.r_[0, target.astype(np.int8), 0])  # +1 at a run of targets' first bar, -1 past its last
        for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1):  # each run, inclusive
            a0 = max(floor, a - rule.before)
            if b + 1 - a0 < rule.min_bars:
                name = str(panel.names[s])
                dropped[name] = dropped.get(name, 0) + int(b + 1 - a0)
                continue
            pieces.append(np.arange(first + a0, first + b + 1))
            kept.append(s)
            lengths.append(b + 1 - a0)
    rows = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    split = SeriesPanel(np.ascontiguousarray(panel.features[:, rows]), np.asarray(panel.stamps)[rows],
                        np.r_[0, np.cumsum(lengths)].astype(np.int64), [str(panel.names[k]) for k in kept],
                        np.asarray(panel.datetimes)[rows])
    return split, dropped


def _show(names: dict[str, int], limit: int = 10) -> str:
    items = sorted(names.items())
    text = ", ".join(f"{n} ({k})" for n, k in items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def make_splits(panel: SeriesPanel, cfg: QlibConfig, member: np.ndarray | None = None,
                calendar: pd.DatetimeIndex | None = None) -> tuple[dict[str, SeriesPanel], dict[str, Any]]:
    """Cut the three splits (targets restricted to `member` bars when given); raise one ConfigError naming each
    time range that leaves its split empty."""
    problems = Problems("The time ranges leave a split empty")
    splits, report = {}, {}
    for rule in split_rules(cfg, calendar):
        split, dropped = cut_split(panel, rule, member)
        key = f"data.{rule.name}_time_range"
        if dropped:
            log.warning("[%s] dropped %d instrument(s) with fewer than %d usable bars: %s",
                        rule.name, len(dropped), rule.min_bars, _show(dropped))
        if split.n_series == 0:
            problems.add(key, f"leaves the {rule.name} split empty: no instrument has {rule.min_bars} bars from "
                              f"{rule.before} bars before {rule.start.date()} to {rule.end.date()}"
                              + (f" ({len(dropped)} instruments have fewer)" if dropped else "")
                              + "; widen the range or shorten data.lookback / data.predict")
        dates = date_range(split)
        splits[rule.name] = split
        report[rule.name] = {"time_range": [str(rule.start.date()), str(rule.end.date())],
                             "instruments": len(set(split.names)), "series": split.n_series, "rows": split.n_rows,
                             "first_bar": dates[0] if dates else None, "last_bar": dates[1] if dates else None,
                             "context_bars": rule.before, "dropped_too_short": dropped}
        log.info("[%s] %d instruments, %d bars, %s..%s", rule.name, split.n_series, split.n_rows,
                 *(dates or ("-", "-")))
    problems.raise_if_any()
    _note_disjoint_histories(panel, splits["test"])
    return splits, report


def _note_disjoint_histories(panel: SeriesPanel, test: SeriesPanel) -> None:
    """Warn when the instruments' histories do not overlap in time: a stretch of over 30 days with no bar of any
    instrument (the calendar jumps), or a test split never holding two instruments on one day (no cross-section:
    the IC is blank, the top-k backtest holds one stock)."""
    days = np.unique(np.asarray(panel.datetimes).astype("datetime64[ns]").astype("datetime64[D]"))
    if len(days) > 1 and (gap := np.diff(days).astype(np.int64)).max() > 30:
        i = int(gap.argmax())
        log.warning("no instrument has a bar from %s to %s (%d days): the histories do not overlap in time, so "
                    "the splits by date hold different instruments; choose a universe whose members trade together",
                    days[i], days[i + 1], int(gap[i]))
    when = pd.Series(np.asarray(test.datetimes).astype("datetime64[ns]").astype("datetime64[D]"))
    per_day = pd.Series(np.repeat(test.names, test.lengths())).groupby(when.to_numpy()).nunique()
    if len(per_day) and per_day.max() < 2:
        log.warning("the test split never holds two instruments on one day: the IC (a correlation across "
                    "instruments per day) is blank and the top-k backtest holds one stock; widen "
                    "data.test_time_range or choose a universe whose members trade together")


def write_splits(folder: str | Path, splits: dict[str, SeriesPanel], manifest: dict[str, Any]) -> Path:
    """Write every split and the manifest, or nothing: files go to a temporary folder first and are moved into
    `folder` only once all of them are written (the manifest last, so its presence means a complete set)."""
    folder = Path(folder).expanduser()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, split in splits.items():
            save_split(split_path(tmp, name), split)
        manifest["content_sha256"] = content_sha256(tmp)  # the splits' identity (finetune/dataset.py)
        write_json(tmp / MANIFEST_NAME, manifest)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST_NAME).unlink(missing_ok=True)  # an interrupted move must not leave an old manifest
        for name in splits:
            if split_path(folder, name).exists():
                shutil.rmtree(split_path(folder, name))
            os.replace(split_path(tmp, name), split_path(folder, name))
        os.replace(tmp / MANIFEST_NAME, folder / MANIFEST_NAME)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


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
    spans = universe_spans(cfg, start, end)
    if not spans:
        raise ConfigError([f"data.instrument: universe {d.instrument!r} has no member between {start.date()} and "
                           f"{end.date()}"])
    log.info("loading the full history of %d instrument(s) of %s from %s (%s .. %s, %s bars)", len(spans),
             d.instrument, d.qlib_data_path, start.date(), end.date(), d.freq)
    frame = load_frame(cfg, start, end, instruments=list(spans))
    if frame.empty:
        raise ConfigError([f"data.instrument: universe {d.instrument!r} has no data between {start.date()} and "
                           f"{end.date()}"])

    # Fewer bars than one test context cannot serve any split (training windows need lookback + predict).
    panel, frame_report = frame_to_panel(frame, d.amount_source, min_bars=d.lookback, calendar=calendar,
                                         max_gap_days=d.max_gap_days)
    if frame_report.nan_rows:
        log.warning("dropped %d bar(s) with missing values (suspended days) in %d instrument(s): %s",
                    sum(frame_report.nan_rows.values()), len(frame_report.nan_rows), _show(frame_report.nan_rows))
    if frame_report.gaps:
        log.warning("cut %d instrument(s) at gaps of more than %d missing trading days (data.max_gap_days): %s",
                    len(frame_report.gaps), d.max_gap_days, _show(frame_report.gaps))
    if frame_report.short:
        log.warning("dropped pieces of %d instrument(s) with fewer than %d bars: %s",
                    len(frame_report.short), d.lookback, _show(frame_report.short))
    member = membership_mask(panel, spans)
    splits, split_report = make_splits(panel, cfg, member, calendar)

    # The market calendar of the load range plus `predict` days (forecast dates of the last windows).
    hi = min(len(calendar), int(calendar.searchsorted(end, side="right")) + d.predict)
    lo = int(calendar.searchsorted(start, side="left"))
    manifest = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": manifest_settings(cfg),
        "load_range": [str(start.date()), str(end.date())],
        "instruments_loaded": int(frame.index.get_level_values("instrument").nunique()),
        "membership_spells": {k: [[str(a.date()), str(b.date())] for a, b in v] for k, v in spans.items()},
        "nan_rows_dropped": frame_report.nan_rows,
        "gap_cuts": frame_report.gaps,
        "pieces_too_short": frame_report.short,
        "splits": split_report,
        "calendar_ns": datetimes_ns(calendar[lo:hi]).tolist(),
    }
    folder = write_splits(d.dataset_path, splits, manifest)
    log.info("wrote %s", ", ".join(p.name for p in sorted(folder.iterdir())))
    return manifest


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    args = parse_config_args(cli_parser(__doc__), argv)
    require_extra("qlib")  # named before any work (the qlib imports below are lazy)
    cfg = load(args.config, args.set)
    preprocess(cfg)


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
