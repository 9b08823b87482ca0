"""The CSV pipeline's data path, one straight line, read top-down in this module:

    sources (CSV/Parquet files of data.path, or {name: DataFrame} from finetune())
      -> SourceReader: columns resolved (model.features.resolve_columns), cells parsed in blocks, checked
      -> one series at a time: grouped by data.symbol_column, candle checks, cleaning (data.nan_policy)
      -> StoreWriter (finetune/utils/store.py, the one store format, also the Qlib splits'): .npy + manifest
      -> ensure_store: rank 0 reuses the store only if settings, sources' content and arrays' sha256 all match
      -> open_store: a read-only memory-mapped SeriesPanel on every rank
      -> split_data: train / val (/ test) index ranges, by date (shared boundaries) or per series
      -> PanelSegments.dataset: the shared WindowDataset (finetune/utils/windows.py)

Every error is a StoreError / CandleDataError (DataError) naming the source (file, or `frame 'AAPL'`), column,
line and the setting to change; all problems of all sources are collected into one message; a failed preparation
leaves nothing behind.

Timestamps: the model's time features describe the exchange's LOCAL wall-clock time. Stamps with a UTC offset are
converted to `data.timezone` when set (so a DST change still gives 09:30 every morning), else keep the wall-clock
time they state; stamps without one are local already. All stamps of the data carry an offset or none does.
Bar length: the median spacing of a file's sorted stamps; odd files are a warning (an error with data.frequency).
Values beyond float32's finite range are an error. Candle rules: see `candle_problems`.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
import warnings as warnings_module
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from finetune.utils.config_utils import Problems
from finetune.utils.store import (
    MANIFEST,
    SeriesPanel,
    StoreError,
    StoreWriter,
    file_fingerprint,
    open_store,
    read_manifest,
    verify_store,
)
from finetune.utils.windows import (
    PanelSegments,
    WindowDataset,
    date_bounds,
    split_bounds,
    split_panel,
    split_panel_by_date,
)
from finetune_csv.config import (
    CandleDataError,
    DataConfig,
    FrequencyError,
    _parse_expected,
    frequency_problem,
    timezone_problem,
)
from model.features import COLUMN_ALIASES, FEATURES, ColumnError, fill_amount, resolve_columns
from model.fileio import write_json

FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4028235e+38
# A UTC offset (or Z) right after a clock time: "09:30-05:00", "09:30:00.5+0530", "09:30Z". The clock time must
# precede it so a plain date's "-02" (2024-01-02) is not read as an offset.
_OFFSET_RE = r"\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?\s*(?P<off>Z|UTC|[+-]\d{2}(?::?\d{2})?)$"
_SHOW = 5  # how many lines / rows / files an error lists

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Settings and sources


NAN_POLICIES = ("error", "ffill", "drop")
BAD_CANDLE_POLICIES = ("error", "warn")
_MAX_PROBLEMS_SHOWN = 50


@dataclass(frozen=True)
class Frame:
    """A DataFrame handed over from Python (`finetune(data=...)`): one source like one file, named by its key."""

    name: str
    frame: pd.DataFrame

    def table(self) -> pa.Table:
        """The frame as Arrow (a DatetimeIndex becomes a column named after the index, else 'timestamps')."""
        frame = self.frame
        if isinstance(frame.index, pd.DatetimeIndex):
            name = frame.index.name or "timestamps"
            frame = frame.rename_axis(name).reset_index() if name not in frame.columns else frame
        mixed = [c for c in frame.columns if frame[c].dtype == object]  # e.g. numbers and text: read cell by cell
        if mixed:
            frame = frame.astype({c: "string" for c in mixed})
        try:
            return pa.Table.from_pandas(frame, preserve_index=False)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise SourceProblems([f"frame '{self.name}': cannot be read as columns of numbers and times ({e})"]) \
                from None

    def fingerprint(self) -> dict[str, Any]:
        """Like `file_fingerprint`: a content hash of values, index and column names (no mtime)."""
        h = pd.util.hash_pandas_object(self.frame, index=True).to_numpy()
        digest = hashlib.sha256(json.dumps([str(c) for c in self.frame.columns]).encode() + h.tobytes()).hexdigest()
        return {"path": f"frame '{self.name}'", "bytes": int(h.nbytes), "mtime_ns": None, "sha256": digest}


def _default_columns() -> dict[str, str | None]:
    return {f: f for f in ("timestamps",) + FEATURES}


@dataclass(frozen=True)
class StoreSettings:
    """How input files become series; every field is part of the store's identity (a change re-prepares)."""

    # Our field (timestamps, open, high, low, close, volume, amount) -> the file's column name (None = absent).
    columns: Mapping[str, str | None] = field(default_factory=_default_columns)
    # Column whose values split a file into several series; None = one series per file.
    symbol_column: str | None = None
    # strftime format of text timestamps; None = ISO 8601 or inferred from the first value.
    timestamp_format: str | None = None
    nan_policy: str = "error"  # Missing prices/volumes: error | ffill | drop (see finetune_csv.config.DataConfig).
    # IANA zone that offset-carrying stamps are converted to (data.timezone); None = keep their stated clock.
    timezone: str | None = None
    # Expected bar length (data.frequency, e.g. '5min'); None = infer per file and warn about odd files.
    frequency: str | None = None
    # A high below max(open, close) or a low above min(open, close): error | warn (data.bad_candles).
    bad_candles: str = "error"
    # A series whose volume column is zero throughout is an error unless True (data.allow_zero_volume).
    allow_zero_volume: bool = False

    @classmethod
    def from_data_config(cls, data: Any) -> StoreSettings:
        """From a CSV pipeline `DataConfig`-like object (columns, symbol_column, timestamp_format, nan_policy)."""
        cols = data.columns if isinstance(data.columns, Mapping) else vars(data.columns)
        return cls(columns=dict(cols), symbol_column=data.symbol_column, timestamp_format=data.timestamp_format,
                   nan_policy=data.nan_policy, timezone=getattr(data, "timezone", None),
                   frequency=getattr(data, "frequency", None), bad_candles=getattr(data, "bad_candles", "error"),
                   allow_zero_volume=bool(getattr(data, "allow_zero_volume", False)))

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form recorded in (and compared with) the manifest."""
        columns = _default_columns()
        columns.update(self.columns)
        return {"columns": columns, "symbol_column": self.symbol_column,
                "timestamp_format": self.timestamp_format, "nan_policy": self.nan_policy,
                "timezone": self.timezone, "frequency": self.frequency, "bad_candles": self.bad_candles,
                "allow_zero_volume": self.allow_zero_volume}

    def validate(self) -> None:
        """Raise ConfigError (a ValueError) listing every bad setting."""
        p = Problems("Invalid data store settings")
        known = ("timestamps",) + FEATURES
        for key, value in self.columns.items():
            p.check(key in known, f"data.columns.{key}", f"unknown field; the fields are {list(known)}")
            if key in known[:5]:
                p.check(isinstance(value, str) and value != "", f"data.columns.{key}", "must name a column")
        p.check(self.nan_policy in NAN_POLICIES, "data.nan_policy",
                f"must be one of {list(NAN_POLICIES)}, got {self.nan_policy!r}")
        p.check(self.bad_candles in BAD_CANDLE_POLICIES, "data.bad_candles",
                f"must be one of {list(BAD_CANDLE_POLICIES)}, got {self.bad_candles!r}")
        for key, problem in (("data.timezone", timezone_problem(self.timezone)),
                             ("data.frequency", frequency_problem(self.frequency))):
            p.check(problem is None, key, problem or "")
        p.raise_if_any()


@dataclass(frozen=True)
class StoreInfo:
    """A prepared store on disk and how this call got it."""

    path: Path  # The store folder.
    manifest: dict  # Its manifest.json.
    reused: bool  # True when an existing store matched (no parsing was done).
    reason: str  # Why it was reused or (re-)prepared, for the log.

    def open(self) -> SeriesPanel:
        """The store as a SeriesPanel of read-only memory maps."""
        return open_store(self.path)


Sources = str | Path | Sequence[str | Path] | Mapping[str, pd.DataFrame]


def list_sources(sources: Sources) -> list[Path | Frame]:
    """Input files: a .csv/.parquet file, a folder (its .csv/.parquet/.pq files, sorted by name), or a list of them;
    or {name: DataFrame} from Python (one Frame each, in the mapping's order)."""
    if isinstance(sources, Mapping):
        bad = [str(k) for k, v in sources.items() if not isinstance(v, pd.DataFrame)]
        if not sources or bad:
            raise StoreError(f"data: give a DataFrame, a dict {{name: DataFrame}} or a path (not a DataFrame: {bad})")
        return [Frame(str(k), v) for k, v in sources.items()]
    if isinstance(sources, (str, Path)):
        sources = [sources]
    suffixes = CSV_SUFFIXES + PARQUET_SUFFIXES
    out: list[Path] = []
    for src in sources:
        if isinstance(src, Frame):  # already listed (prepare_store called by ensure_store)
            out.append(src)
            continue
        p = Path(src)
        if p.is_file():
            if p.suffix.lower() not in suffixes:
                raise StoreError(f"data.path: {p} is not a .csv or .parquet file")
            out.append(p)
        elif p.is_dir():
            files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in suffixes)
            others = sorted(f.name for f in p.iterdir() if f.is_file() and f.suffix.lower() not in suffixes
                            and not f.name.startswith("."))
            if others:
                log.info("ignoring %d file(s) in %s that are not .csv/.parquet: %s", len(others), p,
                         ", ".join(others[:5]) + (" ..." if len(others) > 5 else ""))
            if not files:
                raise StoreError(f"data.path: the folder {p} holds no .csv or .parquet file")
            out.extend(files)
        else:
            raise StoreError(f"data.path: {p} does not exist (give a file or a folder of CSV/Parquet files)")
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise StoreError(f"data.path: two input files share a name (series are named by file): {sorted(names)}")
    return out


def _fingerprint(source: Path | Frame, with_hash: bool = True) -> dict[str, Any]:
    return source.fingerprint() if isinstance(source, Frame) else file_fingerprint(source, with_hash)


# ----------------------------------------------------------------------------------------------------------------
# 1. The run's data: store -> panel -> splits (prepare_data, split_data, data_summary_from_store)


def split_row_counts(n_rows: int, cfg: DataConfig) -> dict[str, int]:
    """Rows of each split of a series of `n_rows` (context excluded): {"train", "val", "test"}."""
    train_end, val_end = split_bounds(n_rows, cfg.train_ratio, cfg.val_ratio)
    return {"train": train_end, "val": val_end - train_end, "test": n_rows - val_end}


def split_is_usable(n_rows: int, cfg: DataConfig) -> bool:
    """Whether a series of n_rows gives at least one window in train, in val, and in test when test_ratio > 0."""
    counts = split_row_counts(n_rows, cfg)
    test_ok = cfg.test_ratio == 0 or counts["test"] >= cfg.predict
    return counts["train"] >= cfg.lookback + cfg.predict and counts["val"] >= cfg.predict and test_ok


def min_rows_needed(cfg: DataConfig) -> int:
    """Smallest series length that gives every split at least one window (see `split_is_usable`)."""
    n = cfg.lookback + cfg.predict
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


@dataclass(frozen=True)
class PreparedData:
    """The data of a run: the store on disk, its memory-mapped panel and the time splits as index ranges."""

    store: StoreInfo  # The store folder, its manifest and whether it was reused (and why).
    # All series, features float32 (6, N) and stamps int64 (N, 5) as read-only np.memmap (shared page cache).
    panel: SeriesPanel
    splits: dict[str, PanelSegments]  # train / val (/ test): per-series column ranges of `panel`.
    # How the splits were cut: {"mode": by_date | per_series, "train_end", "val_end" (by_date)}.
    split: dict[str, Any] = field(default_factory=dict)


def prepare_data(cfg: DataConfig, store_dir: str | Path, dist=None, barrier=None, *, with_splits: bool = True,
                 frames: Mapping[str, pd.DataFrame] | None = None) -> PreparedData:
    """The CSV pipeline's data path, top to bottom: sources -> the prepared store (rank 0 prepares or reuses it,
    `ensure_store`) -> the memory-mapped panel -> train / val (/ test) index ranges (`split_data`).

    with_splits False: the whole series only, `splits` {} (the future forecast needs `lookback` rows per series,
    not a usable split). frames: {name: DataFrame} from Python, read instead of `cfg.path`. A failed preparation
    leaves no store and no folder it created.
    """
    store_dir = Path(store_dir)
    is_main = dist is None or dist.is_main
    created = [p for p in [store_dir, *store_dir.parents] if not p.exists()]

    def undo() -> None:
        if is_main and created:
            shutil.rmtree(store_dir, ignore_errors=True)
            for p in created[1:]:  # innermost first; only folders this call made and that are empty now
                if p.is_dir() and not any(p.iterdir()):
                    p.rmdir()

    try:
        info = ensure_store(cfg.path if frames is None else frames, store_dir, StoreSettings.from_data_config(cfg),
                            dist=dist, barrier=barrier)
        panel = info.open()
        if not with_splits:
            return PreparedData(info, panel, {})
        splits, how = split_data(panel, cfg)
    except Exception:
        undo()
        raise
    return PreparedData(info, panel, splits, how)


def series_overlap(panel: SeriesPanel) -> bool:
    """Whether any two series share a stretch of time (their first..last bar intervals intersect)."""
    when, offsets = np.asarray(panel.datetimes), np.asarray(panel.offsets)
    nonempty = np.flatnonzero(np.diff(offsets) > 0)
    first, last = when[offsets[nonempty]], when[offsets[nonempty + 1] - 1]
    order = np.argsort(first, kind="stable")
    return bool((first[order][1:] <= np.maximum.accumulate(last[order])[:-1]).any())


def stamp_text(ns: int) -> str:
    """A bar time for people: `2017-04-28` for a daily bar (midnight), `2017-04-28 09:35:00` otherwise."""
    ts = pd.Timestamp(ns)
    return f"{ts:%Y-%m-%d}" if ts == ts.normalize() else str(ts)


def split_data(panel: SeriesPanel, cfg: DataConfig) -> tuple[dict[str, PanelSegments], dict[str, Any]]:
    """Cut the panel into train / val (/ test) by `data.split`; (splits, how they were cut). Raises DataError when a
    split gets no window (or, per_series, naming each series too short)."""
    mode = cfg.split or ("by_date" if cfg.train_end or series_overlap(panel) else "per_series")
    if mode == "per_series":
        too_short_problems([(name, int(n)) for name, n in zip(panel.names, panel.lengths())], cfg).raise_if_any()
        splits = split_panel(panel, cfg.train_ratio, cfg.val_ratio, cfg.test_ratio, cfg.lookback, cfg.predict)
        _warn_overlapping_periods(splits)
        return splits, {"mode": mode}
    if cfg.train_end is not None:
        train_end = pd.Timestamp(cfg.train_end).value
        val_end = None if cfg.val_end is None else pd.Timestamp(cfg.val_end).value
        source = "data.train_end / data.val_end"
    else:
        train_end, val_end = date_bounds(panel, cfg.train_ratio, cfg.val_ratio, cfg.test_ratio > 0)
        source = f"ratios {cfg.train_ratio}/{cfg.val_ratio}/{cfg.test_ratio} of all candles"
    splits = split_panel_by_date(panel, train_end, val_end, cfg.lookback, cfg.predict)
    how = {"mode": mode, "train_end": stamp_text(train_end),
           "val_end": None if val_end is None else stamp_text(val_end)}
    window = cfg.lookback + cfg.predict
    empty = [name for name, seg in splits.items()
             if not (seg.stop - seg.start >= window).any() or not (seg.stop > seg.first_target).any()]
    if empty:
        raise StoreError(
            f"data.split: by_date: the {', '.join(empty)} split(s) hold no window of data.lookback + data.predict = "
            f"{window} bars with boundaries {how['train_end']} / {how['val_end']} (from {source}; with these ratios "
            f"a series needs at least {min_rows_needed(cfg) + cfg.predict} rows); move the boundaries "
            "(data.train_end, data.val_end or the ratios), add data, lower data.lookback / data.predict, or set "
            "data.split: per_series")
    return splits, how


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


def data_summary_from_store(data: PreparedData, cfg: DataConfig) -> dict:
    """What run_info.json records about the data, from the store's manifest: files with sha256, series, and rows,
    windows and date ranges per split (same keys as the pandas reference's `data_summary`), plus the store folder.
    The same data gives the same summary whether the store was prepared or reused (a resume compares them)."""
    manifest = data.store.manifest
    window = cfg.lookback + cfg.predict
    when = data.panel.datetimes
    per_split = {}
    for name, seg in data.splits.items():
        n = seg.stop - seg.start
        windows = np.where(n >= window, (n - window) // cfg.stride + 1, 0)
        own = seg.stop > seg.first_target  # (S,) series with rows of their own in this split (by_date: not all)
        per_split[name] = {"rows": int((seg.stop - seg.first_target).sum()),
                           "context_rows": int((seg.first_target - seg.start).sum()), "windows": int(windows.sum()),
                           "start": stamp_text(int(np.min(when[seg.first_target[own]]))),
                           "end": stamp_text(int(np.max(when[seg.stop[own] - 1])))}
    return {
        "files": [{"path": f["path"], "bytes": f["bytes"], "sha256": f["sha256"]} for f in manifest["sources"]],
        "series": [{"name": s["name"], "rows": s["rows"], "start": s["start"], "end": s["end"]}
                   for s in manifest["series"]],
        "splits": per_split,
        "split": data.split,
        # Only what identifies the data: whether this run prepared or reused the store is no property of the data,
        # and recording it would make a resumed run's data fingerprint differ (finetune/utils/training_utils.py).
        "store": {"path": str(data.store.path)},
    }


def build_dataset(segments: PanelSegments, cfg: DataConfig) -> WindowDataset:
    """All windows of `lookback + predict` rows, `stride` apart, inside each series' range (never across series).

    Val/test ranges start `lookback` rows before their split (see `split_panel`), so every window of a split predicts
    rows of its own split. Normalisation uses each window's lookback rows only.
    """
    return segments.dataset(cfg.lookback, cfg.predict, stride=cfg.stride, clip=cfg.clip)


# ----------------------------------------------------------------------------------------------------------------
# 2. Reuse or prepare the store (ensure_store, check_store, prepare_store)


def check_store(store_dir: str | Path, sources: Sequence[Path | Frame], settings: StoreSettings,
                verify: bool = True) -> tuple[bool, str, dict | None]:
    """Whether the store at `store_dir` was prepared from `sources` with `settings`, and is intact.

    Returns (reusable, reason, refreshed manifest or None). With `verify` (the main process) every source's
    content is hashed (a CSV edited in place keeping its size and mtime is found) and every array file's sha256 is
    checked (a damaged or truncated array makes the store stale: the reason names the file); a source whose mtime
    alone changed counts as unchanged and the refreshed manifest records its new mtime. Without `verify` (the other
    processes, after the main one) only sizes and mtimes are compared.
    """
    if not Path(store_dir).exists():
        return False, "first run: no store yet", None
    try:
        manifest = read_manifest(store_dir)
    except StoreError as e:
        return False, str(e), None
    old, new = manifest["settings"], settings.as_dict()
    for key in new:
        if old.get(key) != new[key]:
            return False, f"setting data.{key} changed from {old.get(key)!r} to {new[key]!r}", None
    recorded = {s["path"]: s for s in manifest["sources"]}
    current = {_fingerprint(f, with_hash=False)["path"]: f for f in sources}
    added, removed = sorted(set(current) - set(recorded)), sorted(set(recorded) - set(current))
    if added or removed:
        return False, f"input files changed (added {added}, removed {removed})", None
    touched = 0
    for path, source in current.items():
        was, now = recorded[path], _fingerprint(source, with_hash=verify)
        if now["bytes"] != was["bytes"]:
            return False, f"{path} changed ({was['bytes']} -> {now['bytes']} bytes)", None
        if verify and now["sha256"] != was["sha256"]:
            return False, f"{path} changed (its content differs from when the store was prepared)", None
        if now["mtime_ns"] != was["mtime_ns"]:
            if not verify:
                return False, f"{path} was modified after the store was prepared", None
            was["mtime_ns"] = now["mtime_ns"]
            touched += 1
    if verify:
        try:
            verify_store(store_dir, manifest)
            open_store(store_dir)  # shapes and offsets agree with the manifest
        except StoreError as e:
            return False, str(e), None
    reason = "inputs and settings unchanged" + (f" ({touched} file(s) touched, content identical)" if touched else "")
    return True, reason, (manifest if touched else None)


def ensure_store(sources: Sources, store_dir: str | Path,
                 settings: StoreSettings | None = None, *, dist: Any = None,
                 barrier: Callable[[], None] | None = None, block_rows: int = 1 << 20) -> StoreInfo:
    """Reuse the store at `store_dir` if it matches the inputs and settings, else (re-)prepare it; log why.

    With several processes: only the process whose `dist.is_main` is true checks and prepares; every process
    then calls `barrier()` (so the others wait for the store) and opens it. A process that is not main verifies
    cheaply (settings, file sizes and mtimes) that the store on disk is the one for its inputs, so a failure on
    the main rank becomes a clear error there instead of training on a stale store. For a store on node-local
    disk pass an object whose `is_main` is `local_rank == 0`.
    """
    settings = settings or StoreSettings()
    is_main = True if dist is None else bool(dist.is_main)
    wait = barrier or (lambda: None)
    store_dir = Path(store_dir)
    if not is_main:
        wait()
        files = list_sources(sources)
        ok, reason, _ = check_store(store_dir, files, settings, verify=False)
        if not ok:
            raise StoreError(f"the main process did not leave a matching data store in {store_dir} ({reason}); "
                             "see its error")
        return StoreInfo(store_dir, read_manifest(store_dir), reused=True, reason="prepared by the main process")
    error: Exception | None = None
    info: StoreInfo | None = None
    try:
        settings.validate()
        files = list_sources(sources)
        ok, reason, refreshed = check_store(store_dir, files, settings)
        if ok:
            if refreshed is not None:
                write_json(store_dir / MANIFEST, refreshed)
            log.info("data store %s: reusing it (%s)", store_dir, reason)
            info = StoreInfo(store_dir, refreshed or read_manifest(store_dir), reused=True, reason=reason)
        else:
            # A first run is no news (info); a store that exists but cannot be reused is (warning, with why).
            log.log(logging.WARNING if store_dir.exists() else logging.INFO, "data store %s: preparing it (%s)",
                    store_dir, reason)
            prepared = prepare_store(files, store_dir, settings, block_rows=block_rows)
            info = StoreInfo(store_dir, prepared.manifest, reused=False, reason=reason)
    except Exception as e:  # noqa: BLE001  (re-raised after the barrier: the other ranks must not wait forever)
        error = e
    wait()
    if error is not None:
        raise error
    return info


def prepare_store(sources: Sources, out_dir: str | Path,
                  settings: StoreSettings | None = None, *, block_rows: int = 1 << 20) -> StoreInfo:
    """Parse, check and clean every input file into a store at `out_dir`, replacing an older store there (a
    non-empty folder that is not a store is refused). `block_rows`: rows parsed at a time (~100 bytes a row)."""
    settings = settings or StoreSettings()
    settings.validate()
    files = list_sources(sources)
    out_dir = Path(out_dir)
    _refuse_foreign_folder(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    t0 = time.perf_counter()
    try:
        fingerprints = [_fingerprint(f) for f in files]  # before reading: a later edit is then noticed
        manifest = _build(files, StoreWriter(tmp, len(FEATURES)), settings, block_rows,
                          {"settings": settings.as_dict(), "sources": fingerprints,
                           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        log.info("data store %s: %d series, %d rows prepared in %.1f s", out_dir, manifest["n_series"],
                 manifest["n_rows"], time.perf_counter() - t0)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return StoreInfo(out_dir, manifest, reused=False, reason="prepared")


def candle_problems(values: np.ndarray, lines: np.ndarray, columns: Mapping[str, str | None], where: str,
                    unit: str, settings: StoreSettings) -> tuple[list[str], list[str]]:
    """The candle rules of one series, `values (n, 6)` open..amount, `lines (n,)`: (problems, warnings). A price <= 0
    is an error; a high below max(open, close) or a low above min(open, close) is an error (a warning with
    data.bad_candles: warn); a volume column zero throughout is an error unless data.allow_zero_volume. NaN cells
    are left to data.nan_policy.
    """
    problems, notes = [], []
    for i, f in enumerate(FEATURES[:4]):
        bad = values[:, i] <= 0  # NaN compares False
        if bad.any():
            problems.append(f"{where}: column '{columns[f]}' (data.columns.{f}) has {int(bad.sum())} price(s) <= 0 "
                            f"at {unit} {_listed(lines[bad])}; prices must be positive (fix or remove these rows)")
    o, h, lo, c = (values[:, i] for i in range(4))
    for f, bad, rule in (("high", h < np.maximum(o, c), "below max(open, close)"),
                         ("low", lo > np.minimum(o, c), "above min(open, close)")):
        if bad.any():
            text = (f"{where}: column '{columns[f]}' (data.columns.{f}) is {rule} in {int(bad.sum())} candle(s) at "
                    f"{unit} {_listed(lines[bad])}")
            if settings.bad_candles == "error":
                problems.append(text + "; fix the file, or set data.bad_candles: warn to train on them")
            else:
                notes.append(text + " (data.bad_candles: warn)")
    if columns.get("volume") is not None and len(values) and not np.nan_to_num(values[:, 4]).any() \
            and not settings.allow_zero_volume:
        problems.append(f"{where}: column '{columns['volume']}' (data.columns.volume) is zero in every row; set "
                        "data.allow_zero_volume: true if the data has no volume (e.g. an index), or "
                        "data.columns.volume: null")
    return problems, notes


def _build(sources: list[Path | Frame], writer: StoreWriter, settings: StoreSettings, block_rows: int,
           extra: dict[str, Any]) -> dict:
    """Read, check and clean every source into `writer` (one series at a time); the manifest it writes.
    Every problem of every source is collected first; then one StoreError lists them and nothing is kept."""
    problems: list[str] = []
    warnings: list[str] = []
    series: list[dict] = []
    aware: dict[str, bool] = {}  # source name -> stamps carry a UTC offset
    freqs: dict[str, pd.Timedelta] = {}  # series name -> inferred bar length
    try:
        for source in sources:
            try:
                reader = SourceReader(source, settings.as_dict()["columns"], settings.symbol_column,
                                      settings.timestamp_format, block_rows, timezone=settings.timezone)
                for name, ts, values, lines in _file_series(reader, writer.path, block_rows):
                    where = reader.label if name == reader.name else f"{reader.label} (series {name})"
                    bad, notes = candle_problems(values, lines, reader.columns, where, reader.unit, settings)
                    problems.extend(bad)
                    try:
                        ts, values, cleaning = clean_series(ts, values, lines, reader.present, settings.nan_policy,
                                                            where, reader.unit)
                    except SourceProblems as e:
                        problems.extend(e.problems)
                        continue
                    for note in notes + cleaning:
                        log.warning(note)
                    warnings.extend(notes + cleaning)
                    if reader.tz_aware is not None:
                        aware[reader.name] = reader.tz_aware
                    if len(ts) >= 2:
                        freqs[name] = infer_frequency(ts.view("datetime64[ns]"), source=where)
                    if (np.abs(values) > FLOAT32_MAX).any():  # a derived amount (volume * price) can overflow
                        problems.append(f"{where}: the derived amount (volume * mean price) exceeds float32's range "
                                        "(+-3.4e38); rescale the volume or price columns, or give an amount column")
                    if problems:
                        continue  # keep checking the rest, write nothing more
                    writer.append(name, values, wallclock_stamps(ts), ts)
                    series.append({"name": name, "source": reader.label, "rows": len(ts),
                                   "start": str(pd.Timestamp(ts[0])) if len(ts) else None,
                                   "end": str(pd.Timestamp(ts[-1])) if len(ts) else None})
            except SourceProblems as e:
                problems.extend(e.problems)
        problems.extend(_cross_file_checks(aware, freqs, settings, warnings))
        if problems:
            shown = problems[:_MAX_PROBLEMS_SHOWN]
            more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
            raise StoreError(f"the input data has problems ({len(problems)}):\n"
                             + "\n".join(f"  - {p}" for p in shown) + more)
        if not sum(s["rows"] for s in series):
            raise StoreError("no rows left after cleaning (data.nan_policy: drop removed every row)")
        return writer.finish(list(FEATURES), series=series, warnings=warnings, **extra)
    finally:
        writer.close()


def _cross_file_checks(aware: dict[str, bool], freqs: dict[str, pd.Timedelta], settings: StoreSettings,
                       warnings_out: list[str]) -> list[str]:
    """Checks across files: offsets on some files only, bar lengths that differ. Returns the problems; appends the
    warnings to `warnings_out`."""
    problems = []
    try:
        check_tz_consistency(aware)
    except CandleDataError as e:
        problems.append(str(e))
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always", MixedFrequencyWarning)
        try:
            check_frequencies(freqs, settings.frequency)
        except CandleDataError as e:
            problems.append(str(e))
    for w in caught:
        if issubclass(w.category, MixedFrequencyWarning):
            log.warning("%s", w.message)
            warnings_out.append(str(w.message))
    return problems


def _file_series(reader: SourceReader, scratch: Path, block_rows: int):
    """Yield (name, timestamps (n,), values (n, 6), lines (n,)) per series of one file, in the CSV pipeline's
    order (one series per file, or one per symbol sorted by name)."""
    if reader.symbol_column is None:
        parts = list(reader.blocks())
        if reader.problems:
            raise SourceProblems(reader.problems)
        yield (reader.name, np.concatenate([b.timestamps for b in parts]),
               np.concatenate([b.values for b in parts]), np.concatenate([b.lines for b in parts]))
        return
    yield from grouped_series(reader, scratch, block_rows)


def _refuse_foreign_folder(out_dir: Path) -> None:
    if out_dir.exists() and not (out_dir / MANIFEST).exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise StoreError(f"{out_dir} exists and is not a prepared data store; it is left untouched. Choose another "
                         "store folder (data.store_dir) or remove it")


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished store into place; an older store is renamed away first and then deleted (processes
    that still map its files keep reading them: unlinked files live until unmapped)."""
    _refuse_foreign_folder(out_dir)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


# ----------------------------------------------------------------------------------------------------------------
# 3. Reading one source (SourceReader) and its columns


MISSING_SPELLINGS = ("", "nan", "NaN", "NA", "N/A", "null", "None")
CSV_SUFFIXES = (".csv",)
PARQUET_SUFFIXES = (".parquet", ".pq")
_MISSING = pa.array(MISSING_SPELLINGS, pa.string())


class SourceProblems(ValueError):
    """Problems of one input file (each message names file, column, row and the setting to change)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class ParsedBlock:
    """Consecutive rows of one file, parsed."""

    # (n,) int64 where each row is in the file as a user finds it (CSV: line number, header = 1; Parquet: row, 1-based).
    lines: np.ndarray
    timestamps: np.ndarray  # (n,) int64 naive wall-clock nanoseconds since 1970-01-01.
    values: np.ndarray  # (n, 6) float64 open..amount; NaN = missing cell; a column the file does not have is 0.
    symbols: np.ndarray | None  # (n,) int32 index into `SourceReader.symbols`, or None without a symbol column.


@dataclass
class _Issue:
    count: int = 0
    rows: list[int] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    def add(self, rows: np.ndarray, examples: list[str] | None = None) -> None:
        self.count += len(rows)
        room = _SHOW - len(self.rows)
        if room > 0:
            self.rows.extend(int(r) for r in rows[:room])
        if examples and len(self.examples) < 3:
            self.examples.extend(examples[: 3 - len(self.examples)])

    def where(self) -> str:
        more = self.count - len(self.rows)
        return ", ".join(map(str, self.rows)) + (f" (+{more} more)" if more > 0 else "")


class SourceReader:
    """One input file (or Frame): the column mapping (see `StoreSettings.columns`) resolved against its header, then
    its rows in parsed blocks of `block_rows`. SourceProblems when it cannot be read or a column is missing."""

    def __init__(self, path: str | Path | Frame, columns: Mapping[str, str | None], symbol_column: str | None = None,
                 timestamp_format: str | None = None, block_rows: int = 1 << 20, timezone: str | None = None):
        self._table = path.table() if isinstance(path, Frame) else None  # a DataFrame from Python, as Arrow
        self.path = None if isinstance(path, Frame) else Path(path)
        self.name = path.name if isinstance(path, Frame) else self.path.name
        """The series name (the file name, or the frame's key) that symbols are appended to."""
        self.label = f"frame '{path.name}'" if isinstance(path, Frame) else str(self.path)
        """How messages name this source: the file path, or `frame 'AAPL'`."""
        self.symbol_column = symbol_column
        self.timestamp_format = timestamp_format
        self.timezone = timezone
        self.tz_aware: bool | None = None
        """Whether this file's stamps carry a UTC offset (known after the first block)."""
        self._messages: list[str] = []  # whole-message problems (candle checks), beside the per-cell issues
        self.block_rows = int(block_rows)
        self.is_parquet = self._table is not None or self.path.suffix.lower() in PARQUET_SUFFIXES
        self.unit = "row(s)" if self.is_parquet else "line(s)"
        self.symbols: list[str] = []
        self._symbol_codes: dict[str, int] = {}
        self._issues: dict[tuple[str, str], _Issue] = {}
        self._guessed_format: str | None = None
        self.n_rows = 0
        header = self._parquet_header() if self.is_parquet else self._csv_header()
        self._unnamed_hint: str | None = None
        columns = self._adopt_unnamed_index(header, dict(columns))
        try:
            self.columns = _resolve_columns(header, columns, symbol_column, self.label)
        except SourceProblems as e:
            if self._unnamed_hint is not None:  # e.g. a to_csv index of numbers: say what the unnamed column is
                e.problems[:] = [p + (f"; the first column has no header (read as '{self._unnamed_hint}'): if it "
                                      f"holds the timestamps set data.columns.timestamps: '{self._unnamed_hint}', "
                                      "else give it a name in the file"
                                      if "timestamps" in p else "") for p in e.problems]
            raise

    # ------------------------------------------------------------------------------------------------------------
    @property
    def present(self) -> tuple[bool, ...]:
        """Per feature: whether the file has that column."""
        return tuple(self.columns.get(f) is not None for f in FEATURES)

    @property
    def problems(self) -> list[str]:
        """Every problem found so far, one message per (column, kind)."""
        out = []
        for (kind, column), issue in self._issues.items():
            out.append(_ISSUE_TEXT[kind].format(file=self.label, column=column, field=self._field_of(column),
                                                n=issue.count, where=f"{self.unit} {issue.where()}",
                                                examples=", ".join(issue.examples), fmt=self._fmt_text(),
                                                symbol=self.symbol_column))
        return out + self._messages

    def blocks(self) -> Iterator[ParsedBlock]:
        """Parsed blocks in file order; cells with problems are recorded in `problems` (their values are NaN/0)."""
        batches = self._parquet_batches() if self.is_parquet else self._csv_batches()
        first = 2 if not self.is_parquet else 1  # line/row number of the first data row
        blank = np.zeros(0, np.int64) if self.is_parquet else blank_lines(self.path)  # the reader skips these
        for batch in batches:
            n = batch.num_rows
            if n == 0:
                continue
            lines = np.arange(first + self.n_rows, first + self.n_rows + n, dtype=np.int64)
            lines += np.searchsorted(blank - np.arange(len(blank)), lines, side="right")  # -> the file's lines
            self.n_rows += n
            yield self._parse(batch, lines)
        if self.n_rows == 0:
            raise SourceProblems([f"{self.label}: the file has a header but no rows"])

    # ------------------------------------------------------------------------------------------------------------
    def _adopt_unnamed_index(self, header: list[str], columns: dict[str, str | None]) -> dict[str, str | None]:
        """Take an unnamed first column (DataFrame.to_csv's index: 'Unnamed: 0'; Parquet: '__index_level_0__') as
        the timestamps when the configured timestamps column is missing and its first value reads as a date."""
        wanted = columns.get("timestamps", "timestamps")
        like = {wanted.lower()} | ({"timestamps", *COLUMN_ALIASES["timestamps"]} if wanted == "timestamps" else set())
        if any(h.strip().lower() in like for h in header) or not header \
                or header[0] not in ("Unnamed: 0", "__index_level_0__"):
            return columns
        first = self._first_value(header[0])
        try:
            ok = first is not None and not pd.isna(pd.to_datetime(first, format=self.timestamp_format))
        except (ValueError, TypeError, OverflowError):
            ok = False
        if ok:
            log.info("%s: no '%s' column; taking the unnamed first column (e.g. %r) as the timestamps "
                     "(set data.columns.timestamps to name another column)", self.name, wanted, first)
            return {**columns, "timestamps": header[0]}
        self._unnamed_hint = header[0]
        return columns

    def _first_value(self, column: str):
        if self._table is not None:
            col = self._table.column(column)
            return col[0].as_py() if len(col) else None
        if self.is_parquet:
            for batch in self._pq.iter_batches(batch_size=1, columns=[column]):
                return batch.column(0)[0].as_py() if batch.num_rows else None
            return None
        with open(self.path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f, skipinitialspace=True)
            next(reader, None)
            row = next(reader, None)
        return row[0].strip() if row else None

    def _csv_header(self) -> list[str]:
        try:
            with open(self.path, newline="", encoding="utf-8-sig") as f:
                row = next(csv.reader(f, skipinitialspace=True), None)
        except UnicodeDecodeError as e:
            raise SourceProblems([f"{self.path}: not a readable CSV ({e})"]) from None
        if not row:
            raise SourceProblems([f"{self.path}: the file is empty"])
        row = [c if c != "" else f"Unnamed: {i}" for i, c in enumerate(row)]  # pandas' names for empty cells
        self._header = row
        return row

    def _csv_batches(self) -> Iterator[pa.RecordBatch]:
        wanted = [c for c in self.columns.values() if c is not None]
        if self.symbol_column is not None:
            wanted.append(self.symbol_column)
        wanted = list(dict.fromkeys(wanted))
        # Column names come from our header read (leading spaces stripped, as pandas' skipinitialspace does).
        names = _unique(self._header)
        opts = pa_csv.ReadOptions(column_names=names, skip_rows=1, block_size=max(1 << 16, self.block_rows * 64))
        conv = pa_csv.ConvertOptions(include_columns=wanted, column_types={c: pa.string() for c in wanted},
                                     strings_can_be_null=False, quoted_strings_can_be_null=False)
        try:
            reader = pa_csv.open_csv(self.path, read_options=opts, convert_options=conv)
            for batch in reader:
                yield from _rebatch(batch, self.block_rows)
        except pa.ArrowInvalid as e:
            raise SourceProblems([f"{self.path}: not a readable CSV ({e})"]) from None

    def _parquet_header(self) -> list[str]:
        if self._table is not None:
            return list(self._table.schema.names)
        try:
            self._pq = pq.ParquetFile(self.path)
        except (pa.ArrowInvalid, OSError) as e:
            raise SourceProblems([f"{self.path}: not a readable Parquet file ({e})"]) from None
        return list(self._pq.schema_arrow.names)

    def _parquet_batches(self) -> Iterator[pa.RecordBatch]:
        wanted = list(dict.fromkeys([c for c in self.columns.values() if c is not None]
                                    + ([self.symbol_column] if self.symbol_column else [])))
        if self._table is not None:
            yield from self._table.select(wanted).to_batches(max_chunksize=self.block_rows)
            return
        try:
            yield from self._pq.iter_batches(batch_size=self.block_rows, columns=wanted)
        except (pa.ArrowInvalid, OSError) as e:
            raise SourceProblems([f"{self.path}: not a readable Parquet file ({e})"]) from None

    # ------------------------------------------------------------------------------------------------------------
    def _parse(self, batch: pa.RecordBatch, lines: np.ndarray) -> ParsedBlock:
        n = batch.num_rows
        ts = self._parse_timestamps(batch.column(self.columns["timestamps"]), lines)
        values = np.zeros((n, len(FEATURES)), dtype=np.float64)  # (n, 6)
        for i, f in enumerate(FEATURES):
            col = self.columns.get(f)
            if col is not None:
                values[:, i] = self._parse_numbers(batch.column(col), col, lines)
        if not any(m.startswith((f"{self.label} line", f"{self.label} row")) for m in self._messages):
            try:  # the first out-of-range value of the file is reported (one message per file)
                check_float32_range(values, [self.columns.get(f) or f for f in FEATURES], self.label,
                                    first_row=int(lines[0]))
            except CandleDataError as e:
                self._messages.append(str(e) if not self.is_parquet else str(e).replace(" line ", " row ", 1))
        symbols = None if self.symbol_column is None else self._parse_symbols(batch.column(self.symbol_column), lines)
        return ParsedBlock(lines=lines, timestamps=ts, values=values, symbols=symbols)

    def _issue(self, kind: str, column: str, rows: np.ndarray, examples: list[str] | None = None) -> None:
        self._issues.setdefault((kind, column), _Issue()).add(rows, examples)

    def _parse_numbers(self, col: pa.Array, name: str, lines: np.ndarray) -> np.ndarray:
        """(n,) float64 with NaN for missing cells."""
        t = col.type
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
            out = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)  # nulls -> NaN (missing)
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            out = self._numbers_from_text(col, name, lines)
        else:
            self._issue("numeric_type", name, lines[:1], [str(t)])
            return np.full(len(col), np.nan)
        inf = np.isinf(out)
        if inf.any():
            self._issue("inf", name, lines[inf])
        return out

    def _numbers_from_text(self, col: pa.Array, name: str, lines: np.ndarray) -> np.ndarray:
        text = pc.utf8_trim_whitespace(col)
        missing = pc.is_in(text, value_set=_MISSING).to_numpy(zero_copy_only=False)
        try:
            out = pc.cast(pc.if_else(pa.array(missing), pa.scalar(None, pa.string()), text),
                          pa.float64()).to_numpy(zero_copy_only=False)
            if not (np.isnan(out) & ~missing).any():  # e.g. 'NAN': pandas reads NaN, the CSV rules call it bad
                return out
        except pa.ArrowInvalid:
            pass
        # Slow path, the CSV pipeline's own routine: exact semantics and the rows to report.
        s = pd.Series(text.to_numpy(zero_copy_only=False), dtype=object)
        values = pd.to_numeric(s.where(~missing), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        bad = np.isnan(values) & ~missing
        if bad.any():
            self._issue("not_number", name, lines[bad], [repr(v) for v in s[bad].head(3)])
        return values

    def _parse_timestamps(self, col: pa.Array, lines: np.ndarray) -> np.ndarray:
        """(n,) int64 naive wall-clock ns; unparseable cells are recorded and set to 0."""
        name = self.columns["timestamps"]
        t = col.type
        try:
            if pa.types.is_timestamp(t):
                self._note_aware(t.tz is not None, lines)
                if t.tz is not None:
                    if self.timezone is not None:
                        col = col.cast(pa.timestamp(t.unit, tz=self.timezone))  # same instants, the exchange's zone
                    col = pc.local_timestamp(col)  # wall-clock time in the column's zone
                return self._ns(pc.cast(col, pa.timestamp("ns")), lines, name)
            if pa.types.is_date(t):
                self._note_aware(False, lines)
                return self._ns(pc.cast(pc.cast(col, pa.timestamp("s")), pa.timestamp("ns")), lines, name)
        except pa.ArrowInvalid:
            self._issue("ts_range", name, lines[:1])
            return np.zeros(len(col), dtype=np.int64)
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            self._issue("ts_type", name, lines[:1], [str(t)])
            return np.zeros(len(col), dtype=np.int64)
        text = pc.utf8_trim_whitespace(col)
        if self.timestamp_format is None:
            try:
                ns = self._ns(pc.cast(text, pa.timestamp("ns")), lines, name)  # ISO 8601, naive
                self._note_aware(False, lines)
                return ns
            except pa.ArrowInvalid:
                pass
        aware = pc.any(pc.match_substring_regex(text, _OFFSET_RE)).as_py() or False
        if aware or self.tz_aware:
            return self._timestamps_with_offsets(text.to_numpy(zero_copy_only=False), lines)
        self._note_aware(False, lines)
        return self._timestamps_pandas(text.to_numpy(zero_copy_only=False), lines, name)

    def _note_aware(self, aware: bool, lines: np.ndarray) -> None:
        """Record whether the stamps carry an offset; a file switching between blocks is a problem."""
        if self.tz_aware is None:
            self.tz_aware = aware
        elif self.tz_aware != aware and not any("carry a UTC offset" in m for m in self._messages):
            self._messages.append(
                f"{self.label}: some timestamps carry a UTC offset and some do not (the change is near {self.unit} "
                f"{int(lines[0])}); write all of them with an offset or none")

    def _timestamps_with_offsets(self, text: np.ndarray, lines: np.ndarray) -> np.ndarray:
        """Offset-carrying text stamps -> naive wall-clock ns (`parse_timestamps`: DST changes, zone)."""
        try:
            idx = parse_timestamps(text, source=self.label, fmt=self._format(text), timezone=self.timezone,
                                   first_row=int(lines[0]))
        except CandleDataError as e:
            if str(e) not in self._messages:
                self._messages.append(str(e))
            return np.zeros(len(text), dtype=np.int64)
        self._note_aware(True, lines)
        return idx.asi8.copy()

    def _ns(self, arr: pa.Array, lines: np.ndarray, name: str) -> np.ndarray:
        ns = arr.cast(pa.int64()).to_numpy(zero_copy_only=False) if arr.null_count == 0 else None
        if ns is None:
            bad = arr.is_null().to_numpy(zero_copy_only=False)
            self._issue("ts_bad", name, lines[bad], ["<empty>"])
            ns = pc.fill_null(arr.cast(pa.int64()), 0).to_numpy()
        return ns

    def _format(self, text: np.ndarray) -> str | None:
        """data.timestamp_format, else the format pandas infers from the file's first value (kept for the file)."""
        if self.timestamp_format is not None:
            return self.timestamp_format
        if self._guessed_format is None and len(text):
            self._guessed_format = pd.tseries.api.guess_datetime_format(str(text[0])) or ""
        return self._guessed_format or None

    def _timestamps_pandas(self, text: np.ndarray, lines: np.ndarray, name: str) -> np.ndarray:
        s = pd.Series(text, dtype=object)
        try:
            ts = pd.to_datetime(s, format=self._format(text), errors="coerce")
        except (ValueError, TypeError) as e:  # e.g. mixed time zones
            self._issue("ts_mixed", name, lines[:1], [str(e)[:120]])
            return np.zeros(len(text), dtype=np.int64)
        if getattr(ts.dt, "tz", None) is not None:
            ts = ts.dt.tz_localize(None)  # wall-clock time where the bar happened
        bad = ts.isna().to_numpy()
        if bad.any():
            self._issue("ts_bad", name, lines[bad], [repr(v) for v in s[bad].head(3)])
        try:
            ns = ts.to_numpy(dtype="datetime64[ns]")
        except (ValueError, OverflowError):
            self._issue("ts_range", name, lines[:1])
            return np.zeros(len(text), dtype=np.int64)
        out = ns.view(np.int64).copy()
        out[bad] = 0
        return out

    def _parse_symbols(self, col: pa.Array, lines: np.ndarray) -> np.ndarray:
        text = pc.utf8_trim_whitespace(pc.cast(col, pa.string()))
        text = pc.fill_null(text, "")
        enc = pc.dictionary_encode(text)
        local = [str(v) for v in enc.dictionary.to_pylist()]
        if "" in local:
            empty = (enc.indices.to_numpy(zero_copy_only=False) == local.index(""))
            self._issue("symbol_empty", self.symbol_column, lines[empty])
        # Codes are global to the file (first appearance order); `symbols[code]` is the name.
        table = np.array([self._symbol_codes.setdefault(s, len(self._symbol_codes)) for s in local], dtype=np.int32)
        self.symbols = list(self._symbol_codes)
        return table[enc.indices.to_numpy(zero_copy_only=False)]

    def _field_of(self, column: str) -> str:
        for f, c in self.columns.items():
            if c == column:
                return f
        return "symbol_column"

    def _fmt_text(self) -> str:
        return f"'{self.timestamp_format}'" if self.timestamp_format else "inferred"


_ISSUE_TEXT = {
    "not_number": (
        "{file}: column '{column}' (data.columns.{field}) has {n} non-numeric value(s) at {where}: {examples}"
    ),
    "inf": "{file}: column '{column}' (data.columns.{field}) has {n} infinite value(s) at {where}",
    "numeric_type": "{file}: column '{column}' (data.columns.{field}) holds {examples}, not numbers",
    "ts_bad": "{file}: column '{column}' (data.columns.timestamps) has {n} unparseable timestamp(s) at {where}, e.g. "
              "{examples} (format {fmt}; set data.timestamp_format)",
    "ts_type": "{file}: column '{column}' (data.columns.timestamps) holds {examples}, not timestamps or text; "
               "store the column as timestamps or strings",
    "ts_range": "{file}: column '{column}' (data.columns.timestamps) has times outside 1677-2262, which nanosecond "
                "timestamps cannot hold (first block at {where})",
    "ts_mixed": "{file}: column '{column}' (data.columns.timestamps) cannot be parsed as one series of times near "
                "{where} ({examples}); use one time zone and format (data.timestamp_format)",
    "symbol_empty": "{file}: column '{symbol}' (data.symbol_column) is empty at {where}",
}


def _unique(names: list[str]) -> list[str]:
    """Header names made unique the way pandas does ('a', 'a.1', ...), so a mapping means the same column."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if n in seen:
            seen[n] += 1
            out.append(f"{n}.{seen[n]}")
        else:
            seen[n] = 0
            out.append(n)
    return out


def _rebatch(batch: pa.RecordBatch, rows: int) -> Iterator[pa.RecordBatch]:
    for start in range(0, batch.num_rows, rows):
        yield batch.slice(start, rows)


def _resolve_columns(header: list[str], wanted: Mapping[str, str | None], symbol_column: str | None,
                     source: str) -> dict[str, str | None]:
    """Our field -> the source's column, by the one column resolver (model.features.resolve_columns: any case,
    aliases such as Date / Datetime / vol / turnover, a close-match hint, duplicates refused). `wanted` is
    data.columns: a field mapped to its own name is matched, one mapped elsewhere (or to null) is explicit.
    A missing volume/amount whose name has a close match is an error (a misspelling must not silently turn real
    volumes into zeros), else it is derived."""
    explicit = {f: c for f, c in wanted.items() if c != f}
    try:
        columns = resolve_columns(header, explicit, where=source)
    except ColumnError as e:
        raise SourceProblems([f"{e}; map the columns with data.columns.<field> (e.g. data.columns.close: Close)"]) \
            from None
    problems = []
    unused = [h for h in header if h not in set(columns.values())]
    for fld in ("volume", "amount"):
        if columns[fld] is None and fld not in explicit:
            close = difflib.get_close_matches(fld, [h.strip().lower() for h in unused], n=1, cutoff=0.6)
            if close:
                name = next(h for h in unused if h.strip().lower() == close[0])
                problems.append(f"{source}: no '{fld}' column, but '{name}' looks like one; set data.columns.{fld}: "
                                f"{name}, or data.columns.{fld}: null if the data has none")
            else:
                log.info("%s: no '%s' column (data.columns.%s); it will be derived", source, fld, fld)
    if symbol_column is not None and symbol_column not in header:
        close = difflib.get_close_matches(symbol_column, header, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(f"{source}: symbol column '{symbol_column}' (data.symbol_column) not found{hint}")
    if problems:
        raise SourceProblems(problems)
    if columns["volume"] is None and columns["amount"] is not None:
        raise SourceProblems([(f"{source}: has an amount column but no volume column; set data.columns.amount: "
                               "null or map data.columns.volume")])
    return columns


# ----------------------------------------------------------------------------------------------------------------
# 4. One series: grouping by symbol, cleaning, calendar stamps


_NS_PER_DAY = 86_400_000_000_000
_NS_PER_MINUTE = 60_000_000_000


def _listed(items: Sequence) -> str:
    """The first `_SHOW` items (lines, rows or files) comma-separated, and how many more there are."""
    shown = ", ".join(str(v) for v in items[:_SHOW])
    return shown + (f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else "")


def clean_series(ts: np.ndarray, values: np.ndarray, lines: np.ndarray, present: tuple[bool, ...], nan_policy: str,
                 where: str, unit: str = "line(s)") -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Sort, refuse duplicate stamps, apply `nan_policy` and derive a missing amount for one series: `ts (n,)` int64
    wall-clock ns, `values (n, 6)` open..amount (NaN = missing, absent columns 0), `lines (n,)`.
    Returns (ts (m,), values (m, 6), warnings); SourceProblems on duplicates or refused missing values."""
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


def grouped_series(reader: SourceReader, scratch: Path, block_rows: int) -> Iterator[tuple]:
    """Yield (name, timestamps (n,) int64, values (n, 6) float64, lines (n,) int64) per symbol of one file, sorted
    by symbol name (the CSV pipeline's order), rows of a symbol in file order. Scratch files go to `scratch` and
    are removed at the end."""
    spill = {k: scratch / f".spill.{k}" for k in ("ts", "values", "lines", "codes")}
    counts = np.zeros(0, dtype=np.int64)
    try:
        with open(spill["ts"], "wb") as f_ts, open(spill["values"], "wb") as f_v, \
                open(spill["lines"], "wb") as f_l, open(spill["codes"], "wb") as f_c:
            for b in reader.blocks():
                b.timestamps.tofile(f_ts)
                b.values.tofile(f_v)
                b.lines.tofile(f_l)
                b.symbols.tofile(f_c)
                counts = np.pad(counts, (0, len(reader.symbols) - len(counts)))
                counts += np.bincount(b.symbols, minlength=len(reader.symbols))
        if reader.problems:
            raise SourceProblems(reader.problems)
        n = int(counts.sum())
        order = sorted(range(len(reader.symbols)), key=lambda c: reader.symbols[c])  # by symbol name
        start = np.zeros(len(counts), dtype=np.int64)
        start[order] = np.concatenate([[0], np.cumsum(counts[order])[:-1]])
        src = {"ts": np.memmap(spill["ts"], np.int64, "r", shape=(n,)),
               "values": np.memmap(spill["values"], np.float64, "r", shape=(n, len(FEATURES))),
               "lines": np.memmap(spill["lines"], np.int64, "r", shape=(n,))}
        codes = np.memmap(spill["codes"], np.int32, "r", shape=(n,))
        dst = {k: np.memmap(scratch / f".grouped.{k}", a.dtype, "w+", shape=a.shape) for k, a in src.items()}
        cursor = start.copy()
        for a in range(0, n, block_rows):
            c = np.asarray(codes[a : a + block_rows])
            perm = np.argsort(c, kind="stable")
            sc = c[perm]
            rank = np.arange(len(sc)) - np.searchsorted(sc, sc, side="left")  # position within its symbol
            where = cursor[sc] + rank
            for k in src:
                dst[k][where] = np.asarray(src[k][a : a + block_rows])[perm]
            cursor += np.bincount(c, minlength=len(cursor))
        del src, codes
        for c in order:
            rows = slice(int(start[c]), int(start[c] + counts[c]))
            yield (f"{reader.name}[{reader.symbols[c]}]", np.array(dst["ts"][rows]),
                   np.array(dst["values"][rows]), np.array(dst["lines"][rows]))
        del dst
    finally:
        for p in list(spill.values()) + [scratch / f".grouped.{k}" for k in ("ts", "values", "lines")]:
            p.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------------
# 5. Checks on timestamps, zones, bar lengths and float32 range


class TimestampError(CandleDataError):
    """A timestamp that cannot be read, or a file mixing stamps with and without a UTC offset."""


class TimezoneMixError(CandleDataError):
    """Files with UTC offsets and files without them in one data set."""


class Float32RangeError(CandleDataError):
    """A value outside float32's finite range."""


class MixedFrequencyWarning(UserWarning):
    """Files of different bar lengths in one data set while `data.frequency` is not set."""


def blank_lines(path: str | Path, chunk: int = 1 << 26) -> np.ndarray:
    """1-based numbers of the empty lines ('' or a lone '\\r') of a text file, ascending: the CSV reader skips them,
    so the n-th non-empty line is line n + (blank lines before it). Read in chunks of `chunk` bytes, memory-mapped."""
    size = Path(path).stat().st_size
    data = np.memmap(path, np.uint8, "r") if size else np.zeros(0, np.uint8)
    found, line, last_nl = [], 1, -1  # line: number of the line the next newline ends
    for start in range(0, size, chunk):
        nl = np.flatnonzero(data[start:start + chunk] == 10) + start  # newline offsets
        if not len(nl):
            continue
        length = nl - np.concatenate([[last_nl], nl[:-1]]) - 1  # bytes of each line before its newline
        blank = (length == 0) | ((length == 1) & (data[nl - 1] == 13))
        found.append(line + np.flatnonzero(blank))
        line, last_nl = line + len(nl), int(nl[-1])
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)


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
    """One file's `values (N,)` (text or datetimes, naive or aware) as an (N,) naive ns DatetimeIndex of local
    wall-clock times (the rule in the module docstring); `first_row` is the file line of values[0]."""
    s = pd.Series(values).reset_index(drop=True)
    if isinstance(s.dtype, pd.DatetimeTZDtype) or pd.api.types.is_datetime64_dtype(s.dtype):
        parsed = s
    else:
        text = s.astype("string").str.strip()
        missing = np.flatnonzero((text.isna() | (text == "")).to_numpy())
        if len(missing):
            raise TimestampError(f"{source}: empty timestamp at line(s) {_listed(first_row + missing)}; every candle "
                                 "needs a time (fix the file)")
        off = _offset_text(text)
        aware = off.notna().to_numpy()
        if aware.any() and not aware.all():
            with_, without = np.flatnonzero(aware), np.flatnonzero(~aware)
            raise TimestampError(
                f"{source}: some timestamps carry a UTC offset (line(s) {_listed(first_row + with_)}, e.g. "
                f"'{text[with_[0]]}') and some do not (line(s) {_listed(first_row + without)}, e.g. "
                f"'{text[without[0]]}'); write all of them with an offset or none")
        parsed = pd.to_datetime(text, format=fmt, errors="coerce", utc=bool(aware.any()))
        bad = np.flatnonzero(parsed.isna().to_numpy())
        if len(bad):
            how = f"format '{fmt}'" if fmt else "an inferred format"
            raise TimestampError(
                f"{source}: cannot read timestamp(s) at line(s) {_listed(first_row + bad)}, e.g. '{text[bad[0]]}' "
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
            f"data: {len(with_)} file(s) have timestamps with a UTC offset ({_listed(with_)}) and {len(without)} "
            f"without ({_listed(without)}); they cannot be put on one clock. Write all files with offsets (and set "
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
    day, hour, minute, second = (pd.Timedelta(1, u) for u in ("D", "h", "min", "s"))
    if td % day == pd.Timedelta(0) and td >= day:
        n = td // day
        return f"{n} day" + ("s" if n != 1 else "")
    for unit, name in ((hour, "h"), (minute, "min"), (second, "s")):
        if td % unit == pd.Timedelta(0) and td >= unit:
            return f"{td // unit}{name}"
    return str(td)


def check_frequencies(freqs: Mapping[str, pd.Timedelta], expected: str | pd.Timedelta | None = None
                      ) -> pd.Timedelta | None:
    """The data set's bar length from {file: `infer_frequency`}: `expected` (data.frequency), else the most common
    one (None for no files). Odd files: FrequencyError when `expected` is set, else a MixedFrequencyWarning."""
    if expected is not None:
        want = _parse_expected(expected)
        odd = {f: td for f, td in freqs.items() if pd.Timedelta(td) != want}
        if odd:
            listed = _listed([f"{f} ({format_frequency(td)})" for f, td in odd.items()])
            raise FrequencyError(
                f"data.frequency is {format_frequency(want)} but {len(odd)} file(s) have another bar length: "
                f"{listed}; remove or resample them, or change data.frequency")
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
            groups.append(f"{format_frequency(td)}: {_listed(files)}")
        warnings_module.warn(
            f"data: files of different bar lengths are mixed; most are {format_frequency(common)} "
            f"({counts[common]} file(s)), the others: {'; '.join(groups)}. Set data.frequency to make this an "
            "error, or remove/resample the odd files", MixedFrequencyWarning, stacklevel=2)
    return common


def check_float32_range(array: Any, columns: Sequence[str], source: str, first_row: int = 1) -> None:
    """Raise `Float32RangeError` at the first value (row-major) of `array (N, C)` or `(N,)` with |x| > float32's max
    (inf included; NaN not); `first_row` is the file line of row 0."""
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
