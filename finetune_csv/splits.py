"""Cutting the prepared panel into train / val (/ test) by data.split: by_date (every series cut at the same dates:
data.train_end / data.val_end, or the ratios of all candles) or per_series (each series by its own rows), as index
ranges (no copies); the length rules a series must meet; and the windows a split yields (`build_dataset`)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pandas as pd

from finetune.utils.config_utils import Problems
from finetune.utils.errors import StoreError
from finetune.utils.plots import stamp_text
from finetune.utils.store import SeriesPanel
from finetune.utils.windows import PanelSegments, WindowDataset
from finetune_csv.config import DataConfig
from model.config import Window

log = logging.getLogger(__name__)


def split_bounds(n_rows: int, train_ratio: float, val_ratio: float) -> tuple[int, int]:
    """Row indices (train_end, val_end) of a series of n_rows (the CSV pipeline's rounding)."""
    train_end = int(n_rows * train_ratio)
    val_end = int(round(n_rows * (train_ratio + val_ratio), 9))  # round(): 0.7 + 0.2 must not lose a row
    return train_end, val_end


def split_panel(panel: SeriesPanel, train_ratio: float, val_ratio: float, test_ratio: float,
                window: Window) -> dict[str, PanelSegments]:
    """Cut every series by time into train / val / (test when test_ratio > 0) index ranges. The lengths are the
    caller's to check first (`too_short_problems`: train needs lookback + predict rows, val and test predict rows)."""
    lookback = window.lookback
    lengths = panel.lengths()
    offsets = np.asarray(panel.offsets, dtype=np.int64)
    bounds = np.array([split_bounds(int(n), train_ratio, val_ratio) for n in lengths], dtype=np.int64).reshape(-1, 2)
    train_end, val_end = bounds[:, 0], bounds[:, 1]
    first = offsets[:-1]
    out = {"train": PanelSegments(panel, first, first, first + train_end),
           "val": PanelSegments(panel, first + train_end - lookback, first + train_end, first + val_end)}
    if test_ratio > 0:
        out["test"] = PanelSegments(panel, first + val_end - lookback, first + val_end, first + lengths)
    return out


def date_bounds(panel: SeriesPanel, train_ratio: float, val_ratio: float, test: bool,
                stop: np.ndarray | None = None) -> tuple[int, int | None]:
    """(train_end, val_end or None) in ns: dates that put the ratios of ALL candles (every series pooled) before,
    between and after them, so every series is cut at the same dates and each split holds about its share of the
    data. (Ratios of the distinct dates instead would hand the held-out splits to whichever series runs longest: on
    daily US data from 1986-2025, a test of only the one stock still listed in 2021.) val_end is None without a
    test split. `stop` (S,) panel columns: only each series' candles before it count (a walk-forward fold's span)."""
    when = np.asarray(panel.datetimes)
    if stop is not None:
        when = np.concatenate([when[o:e] for o, e in zip(np.asarray(panel.offsets)[:-1], stop)])
    pooled = np.sort(when)  # (N,) int64 ns, one entry per candle
    train_end, val_end = split_bounds(len(pooled), train_ratio, val_ratio)
    last = len(pooled) - 1
    return int(pooled[min(train_end, last)]), (int(pooled[min(val_end, last)]) if test else None)


def split_panel_by_date(panel: SeriesPanel, train_end: int, val_end: int | None,
                        window: Window) -> dict[str, PanelSegments]:
    """Cut every series at the same dates (ns): train = bars before `train_end`, val = bars from `train_end` (to
    `val_end`), test = bars from `val_end` (only when `val_end` is given).

    Purge: a split's own rows stop `predict` bars before the next split begins, so the last training window's
    targets end `predict` bars before the first validation target (the same between val and test). Val/test ranges
    start up to `lookback` bars before their first own row (context), never before the series' first bar. A series
    without bars in a split gets an empty range there (no window); the caller checks that each split has windows."""
    if panel.datetimes is None:
        raise ValueError("a date split needs the bar datetimes (SeriesPanel.datetimes)")
    when = np.asarray(panel.datetimes)
    offsets = np.asarray(panel.offsets, dtype=np.int64)
    first, last = offsets[:-1], offsets[1:]

    def cut(t: int) -> np.ndarray:  # (S,) first column of each series at or after t (bars are sorted in time)
        return np.array([o + np.searchsorted(when[o:e], t) for o, e in zip(first.tolist(), last.tolist())],
                        dtype=np.int64).reshape(-1)

    b1 = cut(train_end)
    b2 = last if val_end is None else cut(val_end)

    def held_out(begin: np.ndarray, end: np.ndarray) -> PanelSegments:
        return PanelSegments(panel, np.maximum(first, begin - window.lookback), begin, np.maximum(begin, end))

    out = {"train": PanelSegments(panel, first, first, np.maximum(first, b1 - window.predict)),
           "val": held_out(b1, b2 - window.predict if val_end is not None else b2)}
    if val_end is not None:
        out["test"] = held_out(b2, last)
    return out

def split_row_counts(n_rows: int, cfg: DataConfig) -> dict[str, int]:
    """Rows of each split of a series of `n_rows` (context excluded): {"train", "val", "test"}."""
    train_end, val_end = split_bounds(n_rows, cfg.train_ratio, cfg.val_ratio)
    return {"train": train_end, "val": val_end - train_end, "test": n_rows - val_end}


def split_is_usable(n_rows: int, cfg: DataConfig) -> bool:
    """Whether a series of n_rows gives at least one window in train, in val, and in test when test_ratio > 0."""
    counts = split_row_counts(n_rows, cfg)
    test_ok = cfg.test_ratio == 0 or counts["test"] >= cfg.predict
    return counts["train"] >= cfg.window.size and counts["val"] >= cfg.predict and test_ok


def min_rows_needed(cfg: DataConfig) -> int:
    """Smallest series length that gives every split at least one window (see `split_is_usable`)."""
    # int(n * train_ratio) >= size needs n >= size / train_ratio: start just below it, not one row at a time from size
    n = max(cfg.window.size, int(cfg.window.size / cfg.train_ratio) - 1)
    while not split_is_usable(n, cfg):
        n += 1
    return n


def too_short_problems(rows: list[tuple[str, int]], cfg: DataConfig) -> Problems:
    """One Problems entry per (series name, row count) too short for a window in every split; empty when none is."""
    problems = Problems(
        f"Series too short for one window per split: each needs at least {min_rows_needed(cfg)} rows with "
        f"data.lookback={cfg.lookback}, data.predict={cfg.predict} and ratios {cfg.train_ratio}/{cfg.val_ratio}/"
        f"{cfg.test_ratio} (train needs lookback + predict rows, val and test need predict rows); "
        "lower data.lookback / data.predict, change the ratios, or remove these series")
    for name, n in rows:
        if not split_is_usable(n, cfg):
            problems.add(name, f"{n} rows {split_row_counts(n, cfg)}")
    return problems


def series_overlap(panel: SeriesPanel) -> bool:
    """Whether any two series share a stretch of time (their first..last bar intervals intersect)."""
    when, offsets = np.asarray(panel.datetimes), np.asarray(panel.offsets)
    nonempty = np.flatnonzero(np.diff(offsets) > 0)
    first, last = when[offsets[nonempty]], when[offsets[nonempty + 1] - 1]
    order = np.argsort(first, kind="stable")
    return bool((first[order][1:] <= np.maximum.accumulate(last[order])[:-1]).any())


def split_data(panel: SeriesPanel, cfg: DataConfig) -> tuple[dict[str, PanelSegments], dict[str, Any]]:
    """Cut the panel into train / val (/ test) by `data.split`; (splits, how they were cut). Raises DataError when a
    split gets no window (or, per_series, naming each series too short)."""
    mode = cfg.split or ("by_date" if cfg.train_end or series_overlap(panel) else "per_series")
    if mode == "per_series":
        too_short_problems([(name, int(n)) for name, n in zip(panel.names, panel.lengths())], cfg).raise_if_any()
        splits = split_panel(panel, cfg.train_ratio, cfg.val_ratio, cfg.test_ratio, cfg.window)
        _warn_overlapping_periods(splits)
        return splits, {"mode": mode}
    if cfg.train_end is not None:
        train_end = pd.Timestamp(cfg.train_end).value
        val_end = None if cfg.val_end is None else pd.Timestamp(cfg.val_end).value
        source = "data.train_end / data.val_end"
    else:
        train_end, val_end = date_bounds(panel, cfg.train_ratio, cfg.val_ratio, cfg.test_ratio > 0)
        source = f"ratios {cfg.train_ratio}/{cfg.val_ratio}/{cfg.test_ratio} of all candles"
    splits = split_panel_by_date(panel, train_end, val_end, cfg.window)
    how = {"mode": mode, "train_end": stamp_text(train_end),
           "val_end": None if val_end is None else stamp_text(val_end)}
    window = cfg.window.size
    empty = [name for name, seg in splits.items()
             if not (seg.stop - seg.start >= window).any() or not (seg.stop > seg.first_target).any()]
    if empty:
        raise StoreError(
            f"data.split: by_date: the {', '.join(empty)} split(s) hold no window of data.lookback + data.predict = "
            f"{window} bars with boundaries {how['train_end']} / {how['val_end']} (from {source}; with these ratios "
            f"a series needs at least {min_rows_needed(cfg) + cfg.predict} rows); move the boundaries "
            "(data.train_end, data.val_end or the ratios), add data, lower data.lookback / data.predict, or set "
            "data.split: per_series")
    for name, seg in splits.items():  # a series left out of one split is named, never dropped silently
        none = ~((seg.stop - seg.start >= window) & (seg.stop > seg.first_target))  # (S,)
        if none.any():
            log.warning("data.split: by_date: %s %s no %s window (boundaries %s / %s)", ", ".join(np.asarray(
                panel.names)[none]), "has" if none.sum() == 1 else "have", name, how["train_end"], how["val_end"])
    return splits, how


def held_out_from(panel: SeriesPanel, run_info: dict) -> dict[str, int]:
    """{series: earliest first-target time (ns) of a window that lies after what the run in `run_info` (its
    run_info.json) trained and validated on}: by_date its test boundary (or, without one, after its last bar);
    per_series each series' own row split of the rows it had. Series the run never saw are absent (all clean)."""
    data, ratios = run_info.get("data") or {}, (run_info.get("config") or {}).get("data") or {}
    how, when = data.get("split") or {}, np.asarray(panel.datetimes)
    rows = {str(n): (int(o), int(k)) for n, o, k in zip(panel.names, panel.offsets[:-1], panel.lengths())}
    bounds = {}
    for s in data.get("series") or []:
        after_end = pd.Timestamp(s["end"]).value + 1  # the run saw every bar it had
        if how.get("mode") == "by_date":
            bounds[s["name"]] = pd.Timestamp(how["val_end"]).value if how.get("val_end") else after_end
        elif s["name"] in rows:  # (its first column, its rows) now
            first, n = rows[s["name"]]
            val_end = split_bounds(s["rows"], ratios["train_ratio"], ratios["val_ratio"])[1]
            bounds[s["name"]] = int(when[first + val_end]) if val_end < min(s["rows"], n) else after_end
    return bounds


def _warn_overlapping_periods(splits: dict[str, PanelSegments]) -> None:
    """per_series: warn when a series' validation or test period begins before another series' training (or, for
    test, validation) period ends: correlated series then leak the future into training and model selection."""
    panel = splits["train"].panel
    if panel.n_series < 2:
        return
    when = np.asarray(panel.datetimes)
    ends = {k: when[np.maximum(seg.stop - 1, seg.start)] for k, seg in splits.items()}  # (S,) last bar per split
    starts = {k: when[np.minimum(seg.first_target, len(when) - 1)] for k, seg in splits.items()}  # (S,) first bar
    for held, earlier in (("val", ("train",)), ("test", ("train", "val"))):
        if held not in splits:
            continue
        begins = starts[held]
        for other in earlier:
            i = int(np.argmin(begins))
            later = np.flatnonzero(ends[other] > begins[i])
            later = later[later != i]
            if len(later):
                j = int(later[np.argmax(ends[other][later])])
                log.warning("data.split: per_series: the %s period of %s begins %s, before the %s period of %s "
                            "(%s .. %s) ends; related series then leak the future into training. Set data.split: "
                            "by_date to cut every series at the same dates", held, panel.names[i],
                            pd.Timestamp(begins[i]), other, panel.names[j], pd.Timestamp(starts[other][j]),
                            pd.Timestamp(ends[other][j]))
                return


def build_dataset(segments: PanelSegments, cfg: DataConfig) -> WindowDataset:
    """All windows of `data.window.size` rows, `stride` apart, inside each series' range (never across series).

    Val/test ranges start `lookback` rows before their split (see `split_panel`), so every window of a split predicts
    rows of its own split. Normalisation uses each window's lookback rows only."""
    return segments.dataset(cfg.window, stride=cfg.stride)
