"""Prepared data store: parse and check the candle files once, memory-map the result on every rank.

    info = ensure_store(cfg.data.path, store_dir, StoreSettings.from_data_config(cfg.data), dist=dist,
                        barrier=barrier)          # rank 0 prepares (or reuses), the others wait, then all open
    panel = info.open()                           # SeriesPanel of np.memmap arrays (read-only, shared page cache)

On disk (`store_dir/`), all plain uncompressed .npy (memory-mappable) plus two JSON files:

    features_t.npy  float32 (F, N)  feature-major open, high, low, close, volume, amount; series after series
    stamps.npy      int64   (N, 5)  minute, hour, weekday (Monday=0), day of month, month (wall-clock time)
    datetimes.npy   int64   (N,)    bar time, naive wall-clock ns since 1970-01-01
    offsets.npy     int64   (S+1,)  series s is columns offsets[s]:offsets[s+1]
    names.json      [S names]       "file.csv" or "file.csv[SYMBOL]" (the CSV pipeline's names and order)
    manifest.json   format version, settings, source fingerprints (path, bytes, mtime_ns, sha256), per-series rows
                    and date ranges, warnings raised while preparing

Inputs are streamed (Arrow's CSV reader in blocks, Parquet `iter_batches`), so files larger than memory can be
prepared; what must fit in memory is one series at a time (about 64 bytes a row) and one block. The cleaning rules
(series_cleaning.py; tests/csv_reference.py is an independent pandas version the tests compare with): unsorted
timestamps are sorted with a warning, duplicate timestamps are an error, NaN follow `nan_policy` (error / ffill /
drop), a missing amount is volume * mean(OHLC), a missing volume makes volume and amount 0. The store is built in a
temporary folder and renamed into place, so a failed or interrupted preparation never leaves a half-written store;
any problem raises one `StoreError` listing all of them.

Reuse: a store is reused when its format version, settings and input files match. A file whose size and mtime are
unchanged is taken as unchanged; a file whose mtime changed (touched, copied) is hashed and compared with the
recorded sha256, so only a real change of content re-prepares; the reason is logged and returned in `StoreInfo`.

(Over 400 lines on purpose: the writer and the reader of one on-disk format, and the rules deciding whether it is
still valid, stay in one file so they cannot drift apart.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
import warnings as warnings_module
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from model.fileio import write_json

from .candle_checks import (
    FLOAT32_MAX,
    CandleDataError,
    MixedFrequencyWarning,
    check_frequencies,
    check_tz_consistency,
    frequency_problem,
    infer_frequency,
    timezone_problem,
)
from ..config_utils import Problems
from .panel import SeriesPanel
from ..provenance import sha256_file
from .series_cleaning import clean_series, wallclock_stamps
from .store_writer import FeatureMajorWriter, GrowingNpy
from .streaming_reader import (
    CSV_SUFFIXES,
    FEATURES,
    PARQUET_SUFFIXES,
    SourceProblems,
    SourceReader,
)
from .symbol_grouping import grouped_series

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "StoreError",
    "StoreInfo",
    "StoreSettings",
    "check_store",
    "ensure_store",
    "list_sources",
    "open_store",
    "prepare_store",
    "read_manifest",
    "source_fingerprint",
]

FORMAT = "kronos-series-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
NAN_POLICIES = ("error", "ffill", "drop")
_MAX_PROBLEMS_SHOWN = 50


class StoreError(ValueError):
    """The store cannot be prepared or opened; the message names the file, column, row or setting to change."""


def _default_columns() -> dict[str, str | None]:
    return {f: f for f in ("timestamps",) + FEATURES}


@dataclass(frozen=True)
class StoreSettings:
    """How input files become series; every field is part of the store's identity (a change re-prepares)."""

    columns: Mapping[str, str | None] = field(default_factory=_default_columns)
    """Our field (timestamps, open, high, low, close, volume, amount) -> the file's column name (None = absent)."""
    symbol_column: str | None = None
    """Column whose values split a file into several series; None = one series per file."""
    timestamp_format: str | None = None
    """strftime format of text timestamps; None = ISO 8601 or inferred from the first value."""
    nan_policy: str = "error"
    """Missing prices/volumes: error | ffill | drop (see finetune_csv.config.DataConfig)."""
    timezone: str | None = None
    """IANA zone that offset-carrying stamps are converted to (data.timezone); None = keep their stated clock."""
    frequency: str | None = None
    """Expected bar length (data.frequency, e.g. '5min'); None = infer per file and warn about odd files."""

    @classmethod
    def from_data_config(cls, data: Any) -> StoreSettings:
        """From a CSV pipeline `DataConfig`-like object (columns, symbol_column, timestamp_format, nan_policy)."""
        cols = data.columns if isinstance(data.columns, Mapping) else vars(data.columns)
        return cls(columns=dict(cols), symbol_column=data.symbol_column, timestamp_format=data.timestamp_format,
                   nan_policy=data.nan_policy, timezone=getattr(data, "timezone", None),
                   frequency=getattr(data, "frequency", None))

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form recorded in (and compared with) the manifest."""
        columns = _default_columns()
        columns.update(self.columns)
        return {"columns": columns, "symbol_column": self.symbol_column,
                "timestamp_format": self.timestamp_format, "nan_policy": self.nan_policy,
                "timezone": self.timezone, "frequency": self.frequency}

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
        for key, problem in (("data.timezone", timezone_problem(self.timezone)),
                             ("data.frequency", frequency_problem(self.frequency))):
            p.check(problem is None, key, problem or "")
        p.raise_if_any()


@dataclass(frozen=True)
class StoreInfo:
    """A prepared store on disk and how this call got it."""

    path: Path
    """The store folder."""
    manifest: dict
    """Its manifest.json."""
    reused: bool
    """True when an existing store matched (no parsing was done)."""
    reason: str
    """Why it was reused or (re-)prepared, for the log."""

    def open(self) -> SeriesPanel:
        """The store as a SeriesPanel of read-only memory maps."""
        return open_store(self.path)


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def list_sources(sources: str | Path | Sequence[str | Path]) -> list[Path]:
    """Input files: a .csv/.parquet file, a folder (its .csv/.parquet/.pq files, sorted by name), or a list of them."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    suffixes = CSV_SUFFIXES + PARQUET_SUFFIXES
    out: list[Path] = []
    for src in sources:
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


def source_fingerprint(path: str | Path, with_hash: bool = True) -> dict[str, Any]:
    """{"path", "bytes", "mtime_ns", "sha256"} of one input file (sha256 None when `with_hash` is False)."""
    p = Path(path)
    st = p.stat()
    return {"path": str(p.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": sha256_file(p) if with_hash else None}


# ----------------------------------------------------------------------------------------------------------------
# Preparing


def prepare_store(sources: str | Path | Sequence[str | Path], out_dir: str | Path,
                  settings: StoreSettings | None = None, *, block_rows: int = 1 << 20) -> StoreInfo:
    """Parse, check and clean every input file into a store at `out_dir` (replacing an older store there).

    Parameters
    ----------
    sources: file(s) or folder(s), see `list_sources`.
    out_dir: the store folder; an existing folder that is not a store (and not empty) is refused.
    settings: column mapping and cleaning policies.
    block_rows: rows parsed at a time (memory per block is about 100 bytes a row).

    Returns
    -------
    StoreInfo of the new store. Raises StoreError (one message listing every problem) or ConfigError.
    """
    settings = settings or StoreSettings()
    settings.validate()
    files = list_sources(sources)
    out_dir = Path(out_dir)
    _refuse_foreign_folder(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        fingerprints = [source_fingerprint(f) for f in files]  # before reading: a later edit is then noticed
        manifest = _build(files, tmp, settings, block_rows)
        manifest.update(format=FORMAT, format_version=FORMAT_VERSION, settings=settings.as_dict(),
                        sources=fingerprints, prepare_seconds=round(time.perf_counter() - t0, 3),
                        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        write_json(tmp / MANIFEST, manifest)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return StoreInfo(out_dir, manifest, reused=False, reason="prepared")


def _build(files: list[Path], tmp: Path, settings: StoreSettings, block_rows: int) -> dict:
    """Write the arrays into `tmp`; return the manifest's data part."""
    features = FeatureMajorWriter(tmp / "features_t.npy", len(FEATURES))
    stamps = GrowingNpy(tmp / "stamps.npy", np.int64, (5,))
    datetimes = GrowingNpy(tmp / "datetimes.npy", np.int64)
    problems: list[str] = []
    warnings: list[str] = []
    series: list[dict] = []
    aware: dict[str, bool] = {}  # file name -> stamps carry a UTC offset
    freqs: dict[str, pd.Timedelta] = {}  # series name -> inferred bar length
    try:
        for file in files:
            try:
                reader = SourceReader(file, settings.as_dict()["columns"], settings.symbol_column,
                                      settings.timestamp_format, block_rows, timezone=settings.timezone)
                for name, ts, values, lines in _file_series(reader, tmp, block_rows):
                    where = str(file) if name == file.name else f"{file} (series {name})"
                    try:
                        ts, values, notes = clean_series(ts, values, lines, reader.present, settings.nan_policy,
                                                         where, reader.unit)
                    except SourceProblems as e:
                        problems.extend(e.problems)
                        continue
                    for note in notes:
                        log.warning(note)
                    warnings.extend(notes)
                    if reader.tz_aware is not None:
                        aware[file.name] = reader.tz_aware
                    if len(ts) >= 2:
                        freqs[name] = infer_frequency(ts.view("datetime64[ns]"), source=where)
                    if (np.abs(values) > FLOAT32_MAX).any():  # a derived amount (volume * price) can overflow
                        problems.append(f"{where}: the derived amount (volume * mean price) exceeds float32's range "
                                        "(+-3.4e38); rescale the volume or price columns, or give an amount column")
                    if problems:
                        continue  # keep checking the rest, write nothing more
                    features.append(values)
                    stamps.append(wallclock_stamps(ts))
                    datetimes.append(ts)
                    series.append({"name": name, "source": str(file), "rows": len(ts),
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
        if features.rows == 0:
            raise StoreError("no rows left after cleaning (data.nan_policy: drop removed every row)")
        features.finish()
        stamps.finish()
        datetimes.finish()
    finally:
        features.close()
        stamps.close()
        datetimes.close()
    rows = np.array([s["rows"] for s in series], dtype=np.int64)
    np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(rows)]).astype(np.int64))
    (tmp / "names.json").write_text(json.dumps([s["name"] for s in series]), encoding="utf-8")
    return {"n_rows": int(rows.sum()), "n_series": len(series), "features": list(FEATURES), "series": series,
            "warnings": warnings}


def _cross_file_checks(aware: dict[str, bool], freqs: dict[str, pd.Timedelta], settings: StoreSettings,
                       warnings_out: list[str]) -> list[str]:
    """Checks across files (candle_checks): tz-aware and naive files mixed (error); bar lengths that differ
    (warning naming them, error when data.frequency is set). Returns the problems; appends warnings."""
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
        yield (reader.path.name, np.concatenate([b.timestamps for b in parts]),
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
# Opening and reuse


def read_manifest(store_dir: str | Path) -> dict:
    """The store's manifest; StoreError when there is none or it is of another format version."""
    path = Path(store_dir) / MANIFEST
    if not path.is_file():
        raise StoreError(f"{store_dir} is not a prepared data store (no {MANIFEST}); prepare it first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"{path} cannot be read ({e}); delete the store folder to prepare it again") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{store_dir} holds store format {manifest.get('format_version')!r}, this code reads "
                         f"{FORMAT_VERSION}; delete it to prepare it again")
    return manifest


def open_store(store_dir: str | Path) -> SeriesPanel:
    """The store as a SeriesPanel whose features/stamps/datetimes are read-only `np.memmap`s (no copy: every
    process on a machine shares the page cache's one copy)."""
    store_dir = Path(store_dir)
    manifest = read_manifest(store_dir)
    n, s, f = manifest["n_rows"], manifest["n_series"], len(manifest["features"])
    features = np.load(store_dir / "features_t.npy", mmap_mode="r")
    stamps = np.load(store_dir / "stamps.npy", mmap_mode="r")
    datetimes = np.load(store_dir / "datetimes.npy", mmap_mode="r")
    offsets = np.load(store_dir / "offsets.npy")
    names = json.loads((store_dir / "names.json").read_text(encoding="utf-8"))
    if features.shape != (f, n) or offsets.shape != (s + 1,) or len(names) != s:
        raise StoreError(f"{store_dir}: arrays do not match the manifest (features {features.shape}, "
                         f"{len(names)} names); delete the folder to prepare it again")
    return SeriesPanel(features, stamps, offsets, names, datetimes)


def check_store(store_dir: str | Path, files: Sequence[Path], settings: StoreSettings,
                hash_touched: bool = True) -> tuple[bool, str, dict | None]:
    """Whether the store at `store_dir` was prepared from `files` with `settings`.

    Returns (reusable, reason, refreshed manifest or None). A file with unchanged size and mtime counts as
    unchanged; with `hash_touched` a changed mtime is resolved by comparing sha256 (the refreshed manifest then
    records the new mtimes), without it a changed mtime makes the store stale.
    """
    try:
        manifest = read_manifest(store_dir)
    except StoreError as e:
        return False, str(e), None
    old, new = manifest["settings"], settings.as_dict()
    for key in new:
        if old.get(key) != new[key]:
            return False, f"setting data.{key} changed from {old.get(key)!r} to {new[key]!r}", None
    recorded = {s["path"]: s for s in manifest["sources"]}
    current = [str(Path(f).resolve()) for f in files]
    added, removed = sorted(set(current) - set(recorded)), sorted(set(recorded) - set(current))
    if added or removed:
        return False, f"input files changed (added {added}, removed {removed})", None
    touched = 0
    for path in current:
        was, st = recorded[path], os.stat(path)
        if st.st_size != was["bytes"]:
            return False, f"{path} changed ({was['bytes']} -> {st.st_size} bytes)", None
        if st.st_mtime_ns != was["mtime_ns"]:
            if not hash_touched:
                return False, f"{path} was modified after the store was prepared", None
            if sha256_file(path) != was["sha256"]:
                return False, f"{path} changed (its content differs from when the store was prepared)", None
            was["mtime_ns"] = st.st_mtime_ns
            touched += 1
    reason = "inputs and settings unchanged" + (f" ({touched} file(s) touched, content identical)" if touched else "")
    return True, reason, (manifest if touched else None)


def ensure_store(sources: str | Path | Sequence[str | Path], store_dir: str | Path,
                 settings: StoreSettings | None = None, *, dist: Any = None,
                 barrier: Callable[[], None] | None = None, block_rows: int = 1 << 20) -> StoreInfo:
    """Reuse the store at `store_dir` if it matches the inputs and settings, else (re-)prepare it; log why.

    With several processes: only the process whose `dist.is_main` is true checks and prepares; every process
    then calls `barrier()` (so the others wait for the store) and opens it. A process that is not main verifies
    cheaply (settings, file sizes and mtimes) that the store on disk is the one for its inputs, so a failure on
    the main rank becomes a clear error there instead of training on a stale store. For a store on node-local
    disk pass an object whose `is_main` is `local_rank == 0`.

    Returns StoreInfo (`.open()` gives the SeriesPanel). Raises StoreError / ConfigError on bad data or settings.
    """
    settings = settings or StoreSettings()
    is_main = True if dist is None else bool(dist.is_main)
    wait = barrier or (lambda: None)
    store_dir = Path(store_dir)
    if not is_main:
        wait()
        files = list_sources(sources)
        ok, reason, _ = check_store(store_dir, files, settings, hash_touched=False)
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
            log.warning("data store %s: preparing it (%s)", store_dir, reason)
            prepared = prepare_store(files, store_dir, settings, block_rows=block_rows)
            info = StoreInfo(store_dir, prepared.manifest, reused=False, reason=reason)
    except Exception as e:  # noqa: BLE001  (re-raised after the barrier: the other ranks must not wait forever)
        error = e
    wait()
    if error is not None:
        raise error
    return info
