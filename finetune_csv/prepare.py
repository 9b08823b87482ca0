"""The CSV pipeline's data path, one straight line (`prepare_data`): sources -> checked, cleaned series -> the
prepared store -> a memory-mapped panel -> splits -> the shared WindowDataset. Each step's module and the error
rules: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import warnings as warnings_module
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import finetune.utils.store as store
import finetune_csv.sources as csv_sources
import finetune_csv.timestamps as stamps
from finetune.utils.config_utils import Problems
from finetune.utils.errors import StoreError
from finetune.utils.plots import stamp_text
from finetune.utils.windows import PanelSegments, wallclock_stamps
from finetune_csv.config import DataConfig, check_data_settings
from finetune_csv.splits import split_data
from model.features import FEATURES, candle_faults, fill_amount
from model.fileio import atomic_dir, sha256_file, write_json

_MAX_PROBLEMS_SHOWN = 50

log = logging.getLogger(__name__)


def _default_columns() -> dict[str, str | None]:
    return {f: f for f in ("timestamps",) + FEATURES} | {"factor": None}


@dataclass(frozen=True)
class StoreSettings:
    """How input files become series: each field is the `data:` setting of its name (finetune_csv.config.DataConfig
    documents them; `columns`: our field -> the file's column, None = absent). Every field is part of the store's
    identity (a change re-prepares)."""

    columns: Mapping[str, str | None] = field(default_factory=_default_columns)
    header: str = "first_row"
    symbol_column: str | None = None
    timestamp_format: str | None = None
    timestamp_unit: str | None = None
    adjust: str = "none"
    nan_policy: str = "error"
    timezone: str | None = None
    frequency: str | None = None
    bad_candles: str = "error"
    allow_zero_volume: bool = False
    max_gap_days: int | None = None
    splits_path: str | None = None

    @classmethod
    def from_data_config(cls, data: DataConfig) -> StoreSettings:
        """The `data:` settings that make the store (the same names)."""
        return cls(**{f.name: getattr(data, f.name) for f in fields(cls)} | {"columns": vars(data.columns)})

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form recorded in (and compared with) the manifest; unmapped fields keep their own name."""
        splits = self.splits_path is not None and Path(self.splits_path).is_file()  # its content is identity too
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"columns": {**_default_columns(),
                                                                                     **self.columns}} \
            | ({"splits_sha256": sha256_file(self.splits_path)} if splits else {})

    def validate(self) -> None:
        p = Problems("Invalid data store settings")
        check_data_settings(self.as_dict(), p)
        p.raise_if_any()


@dataclass(frozen=True)
class StoreInfo:
    """A prepared store on disk and how this call got it."""

    path: Path  # The store folder.
    manifest: dict  # Its manifest.json.
    reused: bool  # True when an existing store matched (no parsing was done).
    reason: str  # Why it was reused or (re-)prepared, for the log.

    def open(self) -> store.SeriesPanel:
        """The store as a SeriesPanel of read-only memory maps."""
        return store.open_store(self.path)


@dataclass(frozen=True)
class PreparedData:
    """The data of a run: the store on disk, its memory-mapped panel and the time splits as index ranges."""

    store: StoreInfo  # The store folder, its manifest and whether it was reused (and why).
    # All series, features float32 (6, N) and stamps int64 (N, 5) as read-only np.memmap (shared page cache).
    panel: store.SeriesPanel
    splits: dict[str, PanelSegments]  # train / val (/ test): per-series column ranges of `panel`.
    # How the splits were cut: {"mode": by_date | per_series, "train_end", "val_end" (by_date)}.
    split: dict[str, Any] = field(default_factory=dict)


def prepare_data(cfg: DataConfig, store_dir: str | Path, dist=None, barrier=None, *, with_splits: bool = True,
                 frames: Mapping[str, pd.DataFrame] | None = None) -> PreparedData:
    """The CSV pipeline's data path of the module docstring. with_splits False: `splits` {} (the future forecast
    needs `lookback` rows per series, not a usable split); frames: {name: DataFrame} from Python, read instead of
    `cfg.path`. A failed preparation leaves no store and no folder it created."""
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


def data_summary_from_store(data: PreparedData, cfg: DataConfig) -> dict:
    """What run_info.json records about the data, from the store's manifest: files with sha256, series, and rows,
    windows and date ranges per split (same keys as the pandas reference's `data_summary`), plus the store folder.
    The same data gives the same summary whether the store was prepared or reused (a resume compares them)."""
    manifest = data.store.manifest
    when = data.panel.datetimes
    per_split = {}
    for name, seg in data.splits.items():  # split_data made sure each split has a window
        own = seg.stop > seg.first_target  # (S,) series with rows of their own in this split (by_date: not all)
        per_split[name] = {"rows": int((seg.stop - seg.first_target).sum()),
                           "context_rows": int((seg.first_target - seg.start).sum()),
                           "windows": len(seg.dataset(cfg.window, stride=cfg.stride)),
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


# Reuse or prepare the store (ensure_store, check_store, prepare_store)

def check_store(store_dir: str | Path, sources: Sequence[Path | csv_sources.Frame], settings: StoreSettings,
                verify: bool = True) -> tuple[bool, str, dict | None]:
    """(reusable, reason, refreshed manifest or None): whether the store at `store_dir` was prepared from `sources`
    with `settings` and is intact. With `verify` (the main process) every source's content is hashed (a CSV edited
    in place keeping its size and mtime is found) and every array's sha256 checked (the reason names a damaged
    file); a source whose mtime alone changed is unchanged, and the refreshed manifest records its new mtime.
    Without `verify` (the other processes, after the main one) only sizes and mtimes are compared."""
    if not Path(store_dir).exists():
        return False, "first run: no store yet", None
    try:
        manifest = store.read_manifest(store_dir)
    except StoreError as e:
        return False, str(e), None
    old, new, default = manifest["settings"], settings.as_dict(), StoreSettings().as_dict()
    for key in new:  # a setting newer than the store reads there as its default
        was = old.get(key, default.get(key))
        was = {**default[key], **was} if isinstance(was, dict) else was
        if was != new[key]:
            return False, f"setting data.{key} changed from {was!r} to {new[key]!r}", None
    recorded = {s["path"]: s for s in manifest["sources"]}
    current = {csv_sources.source_fingerprint(f, with_hash=False)["path"]: f for f in sources}
    added, removed = sorted(set(current) - set(recorded)), sorted(set(recorded) - set(current))
    if added or removed:
        return False, f"input files changed (added {added}, removed {removed})", None
    touched = 0
    for path, source in current.items():
        was, now = recorded[path], csv_sources.source_fingerprint(source, with_hash=verify)
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
            store.verify_store(store_dir, manifest)
            store.open_store(store_dir)  # shapes and offsets agree with the manifest
        except StoreError as e:
            return False, str(e), None
    reason = "inputs and settings unchanged" + (f" ({touched} file(s) touched, content identical)" if touched else "")
    return True, reason, (manifest if touched else None)


def ensure_store(sources: csv_sources.Sources, store_dir: str | Path, settings: StoreSettings | None = None, *,
                 dist: Any = None, barrier: Callable[[], None] | None = None, block_rows: int = 1 << 20) -> StoreInfo:
    """Reuse the store at `store_dir` if it matches the inputs and settings, else (re-)prepare it; log why. Only the
    process with `dist.is_main` (node-local disk: `local_rank == 0`) prepares; all then `barrier()` and open it, the
    others verifying sizes and mtimes cheaply, so a failure on the main rank is an error, not a stale store."""
    settings = settings or StoreSettings()
    is_main = True if dist is None else bool(dist.is_main)
    wait = barrier or (lambda: None)
    store_dir = Path(store_dir)
    if not is_main:
        wait()
        files = csv_sources.list_sources(sources)
        ok, reason, _ = check_store(store_dir, files, settings, verify=False)
        if not ok:
            raise StoreError(f"the main process did not leave a matching data store in {store_dir} ({reason}); "
                                   "see its error")
        return StoreInfo(store_dir, store.read_manifest(store_dir), reused=True, reason="prepared by the main process")
    error: Exception | None = None
    info: StoreInfo | None = None
    try:
        settings.validate()
        files = csv_sources.list_sources(sources)
        ok, reason, refreshed = check_store(store_dir, files, settings)
        if ok:
            if refreshed is not None:
                write_json(store_dir / store.MANIFEST, refreshed)
            log.info("data store %s: reusing it (%s)", store_dir, reason)
            info = StoreInfo(store_dir, refreshed or store.read_manifest(store_dir), reused=True, reason=reason)
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


def prepare_store(sources: csv_sources.Sources, out_dir: str | Path,
                  settings: StoreSettings | None = None, *, block_rows: int = 1 << 20) -> StoreInfo:
    """Parse, check and clean every input file into a store at `out_dir`, replacing an older store there (a
    non-empty folder that is not a store is refused). `block_rows`: rows parsed at a time (~100 bytes a row)."""
    settings = settings or StoreSettings()
    settings.validate()
    files = csv_sources.list_sources(sources)
    out_dir = Path(out_dir)
    _refuse_foreign_folder(out_dir)
    t0 = time.perf_counter()
    # Built beside out_dir and swapped in whole; processes that still map an older store's files keep reading
    # them (unlinked files live until unmapped). Each file is parsed from a snapshot of the bytes it was hashed
    # from: the store never records the sha256 of other content than it holds.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out_dir) as tmp, tempfile.TemporaryDirectory(prefix=".sources-", dir=out_dir.parent) as snap:
        snaps = [(f, csv_sources.source_fingerprint(f)) if isinstance(f, csv_sources.Frame) else
                 store.snapshot_file(f, Path(snap, str(i))) for i, f in enumerate(files)]
        fingerprints = [fp for _, fp in snaps]
        tmp.rmdir()  # the StoreWriter makes its folder itself
        manifest = _build([(copy, f) for (copy, _), f in zip(snaps, files)], store.StoreWriter(tmp, len(FEATURES)),
                          settings, block_rows, {"settings": settings.as_dict(), "sources": fingerprints,
                                                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        log.info("data store %s: %d series, %d rows prepared in %.1f s", out_dir, manifest["n_series"],
                 manifest["n_rows"], time.perf_counter() - t0)
        _refuse_foreign_folder(out_dir)  # still a store (or nothing) now that it is replaced
    return StoreInfo(out_dir, manifest, reused=False, reason="prepared")


def _build(sources: list[tuple[Path | csv_sources.Frame, Path | csv_sources.Frame]], writer: store.StoreWriter,
           settings: StoreSettings, block_rows: int, extra: dict[str, Any]) -> dict:
    """Read, check and clean every source (its snapshot, its user-facing path) into `writer` (one series at a time);
    the manifest it writes. Every problem of every source is collected first; then one StoreError lists them and
    nothing is kept. Messages name the user's file, not its snapshot."""
    problems: list[str] = []
    warnings: list[str] = []
    series: list[dict] = []
    aware: dict[str, bool] = {}  # source name -> stamps carry a UTC offset
    zones: set[str | None] = set()  # the zones of the wall clocks of those that do
    freqs: dict[str, pd.Timedelta] = {}  # series name -> inferred bar length
    try:
        splits, used = read_splits(settings.splits_path), set()  # {SYMBOL: [(date ns, ratio), ...]}
        columns = settings.as_dict()["columns"]  # once: as_dict hashes the splits file
        for source, original in sources:
            named = lambda texts, a=str(source), b=str(original): [t.replace(a, b) for t in texts]  # noqa: E731
            try:
                reader = csv_sources.SourceReader(source, columns, settings.symbol_column,
                                                  settings.timestamp_format, block_rows, timezone=settings.timezone,
                                                  adjust=settings.adjust, shown_as=original,
                                                  timestamp_unit=settings.timestamp_unit, header=settings.header)
                for name, ts, values, lines in csv_sources.file_series(reader, writer.path, block_rows):
                    where = reader.label if name == reader.name else f"{reader.label} (series {name})"
                    bad, notes = candle_problems(values, lines, reader.columns, where, reader.unit, settings,
                                                 reader.adj_close)
                    problems.extend(named(bad))
                    try:
                        ts, values, cleaning = clean_series(ts, values, lines, reader.present, settings.nan_policy,
                                                            where, reader.unit)
                    except csv_sources.SourceProblems as e:
                        problems.extend(named(e.problems))
                        continue
                    used.add(series_symbol(name))
                    values = back_adjust(ts, values, splits.get(series_symbol(name), []), where)
                    ts, values, cut = after_last_gap(ts, values, settings.max_gap_days, where)
                    notes, cleaning = named(notes), named(cleaning + cut + jump_notes(ts, values, where))
                    for note in notes + cleaning:
                        log.warning(note)
                    warnings.extend(notes + cleaning)
                    if reader.tz_aware is not None:
                        aware[reader.name] = reader.tz_aware
                        zones |= {reader.zone or None} if reader.tz_aware else set()
                    if len(ts) >= 2:
                        freqs[name] = stamps.infer_frequency(ts.view("datetime64[ns]"), source=where)
                    if (np.abs(values) > csv_sources.FLOAT32_MAX).any():  # a derived amount can overflow
                        problems.append(f"{where}: the derived amount (volume * mean price) exceeds float32's range "
                                        "(+-3.4e38); rescale the volume or price columns, or give an amount column")
                    if problems:
                        continue  # keep checking the rest, write nothing more
                    writer.append(name, values, wallclock_stamps(ts), ts)
                    series.append({"name": name, "source": reader.label, "rows": len(ts),
                                   "start": str(pd.Timestamp(ts[0])) if len(ts) else None,
                                   "end": str(pd.Timestamp(ts[-1])) if len(ts) else None})
            except csv_sources.SourceProblems as e:
                problems.extend(named(e.problems))
        problems.extend(_cross_file_checks(aware, freqs, settings, warnings))
        if unused := sorted(set(splits) - used):  # a vendor's list may cover more symbols than the data: said
            log.info("data.splits_path: no series for %d symbol(s): %s", len(unused), ", ".join(unused[:10]))
        if problems:
            shown = problems[:_MAX_PROBLEMS_SHOWN]
            more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
            raise StoreError(f"the input data has problems ({len(problems)}):\n"
                                   + "\n".join(f"  - {p}" for p in shown) + more)
        if not sum(s["rows"] for s in series):
            raise StoreError("no rows left after cleaning (data.nan_policy: drop removed every row)")
        zone = next(iter(zones)) if len(zones) == 1 else None  # --future's stamps are aware in it
        return writer.finish(list(FEATURES), series=series, warnings=warnings, timezone=zone, **extra)
    finally:
        writer.close()


def _cross_file_checks(aware: dict[str, bool], freqs: dict[str, pd.Timedelta], settings: StoreSettings,
                       warnings_out: list[str]) -> list[str]:
    """Checks across files: offsets on some files only, bar lengths that differ. Returns the problems; appends the
    warnings to `warnings_out`."""
    problems = []
    try:
        stamps.check_tz_consistency(aware)
    except stamps.CandleDataError as e:
        problems.append(str(e))
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always", stamps.MixedFrequencyWarning)
        try:
            stamps.check_frequencies(freqs, settings.frequency)
        except stamps.CandleDataError as e:
            problems.append(str(e))
    for w in caught:
        if issubclass(w.category, stamps.MixedFrequencyWarning):
            log.warning("%s", w.message)
            warnings_out.append(str(w.message))
    return problems


def _refuse_foreign_folder(out_dir: Path) -> None:
    if out_dir.exists() and not (out_dir / store.MANIFEST).exists() and (
            not out_dir.is_dir() or any(out_dir.iterdir())):
        raise StoreError(f"{out_dir} exists and is not a prepared data store; it is left untouched. Choose "
                               "another store folder (data.store_dir) or remove it")


# The rules of one series: candle checks, cleaning

def candle_problems(values: np.ndarray, lines: np.ndarray, columns: Mapping[str, str | None], where: str,
                    unit: str, settings: StoreSettings, adj_close: str | None = None) -> tuple[list[str], list[str]]:
    """The candle rules (`model.features.candle_faults`) of one series, `values (n, 6)` open..amount, `lines (n,)`:
    (problems, warnings). A price <= 0 is an error; a broken high / low rule is an error, or a warning with
    data.bad_candles: warn; a volume column zero throughout is an error unless data.allow_zero_volume. In a file with
    an unused `adj_close` column the likely cause is a close adjusted alone: the fix named is data.adjust, never
    training on the broken candles."""
    problems, notes = [], []
    fix = ("fix the file, or set data.bad_candles: warn to train on them" if adj_close is None or settings.adjust !=
           "none" else f"the file has an '{adj_close}' column: if only it is adjusted for splits and dividends, set "
           "data.adjust: adj_close (all four prices scaled to it) and map data.columns.close to the unadjusted close")
    for f, bad, rule in candle_faults(values):
        column, at = f"column '{columns[f]}' (data.columns.{f})", f"{unit} {stamps.listed(lines[bad])}"
        if rule.startswith("<= 0"):
            problems.append(f"{where}: {column} has {int(bad.sum())} price(s) <= 0 at {at}; prices must be positive "
                            "(fix or remove these rows)")
        elif settings.bad_candles == "error":
            problems.append(f"{where}: {column} is {rule} in {int(bad.sum())} candle(s) at {at}; {fix}")
        else:
            notes.append(f"{where}: {column} is {rule} in {int(bad.sum())} candle(s) at {at} (data.bad_candles: warn)")
    if columns.get("volume") is not None and len(values) and not np.nan_to_num(values[:, 4]).any() \
            and not settings.allow_zero_volume:
        problems.append(f"{where}: column '{columns['volume']}' (data.columns.volume) is zero in every row; set "
                        "data.allow_zero_volume: true if the data has no volume (e.g. an index), or "
                        "data.columns.volume: null")
    return problems, notes


def after_last_gap(ts: np.ndarray, values: np.ndarray, max_gap_days: int | None,
                   where: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """data.max_gap_days: the bars after the last gap of more than that many days (the earlier ones dropped, said):
    a window never joins bars across it, and the series keeps its one name (as --future forecasts its last bars)."""
    gaps = np.flatnonzero(np.diff(ts) > pd.Timedelta(days=max_gap_days or 0).value) if max_gap_days else []
    if not len(gaps):
        return ts, values, []
    k = int(gaps[-1]) + 1
    return ts[k:], values[k:], [f"{where}: dropped the {k} bars before {stamp_text(int(ts[k]))}, after a gap of more "
                                f"than {max_gap_days} days (data.max_gap_days)"]


def read_splits(path: str | None) -> dict[str, list[tuple[int, float]]]:
    """data.splits_path as {SYMBOL: [(date ns, ratio), ...]}: a CSV with columns symbol, date, ratio (any case; a
    ratio 4, 0.125, 4:1 or 1:8); StoreError naming the setting and the line of a bad row."""
    if path is None:
        return {}
    try:
        rows = pd.read_csv(path, dtype=str, skipinitialspace=True).rename(columns=str.lower)[["symbol", "date",
                                                                                                "ratio"]]
    except (KeyError, ValueError, OSError) as e:
        raise StoreError(f"data.splits_path: {path} is not a CSV with columns symbol, date, ratio ({e})") from None
    out: dict[str, list[tuple[int, float]]] = {}
    for line, (symbol, date, ratio) in enumerate(rows.itertuples(index=False), start=2):
        try:
            a, b = (str(ratio).split(":") + ["1"])[:2] if str(ratio).count(":") < 2 else ("", "")
            r, when = float(a) / float(b), pd.Timestamp(date).value
        except (ValueError, TypeError, ZeroDivisionError):
            r = when = None
        if r is None or pd.isna(symbol) or pd.isna(date) or not (np.isfinite(r) and r > 0):
            raise StoreError(f"data.splits_path: {path} line {line}: ({symbol}, {date}, {ratio}) is not a symbol, a "
                             "date and a finite ratio > 0 (4 or 4:1 for a 4:1 split, 0.125 or 1:8 for a 1:8 reverse)")
        out.setdefault(str(symbol).strip().upper(), []).append((when, r))
    return out


def series_symbol(name: str) -> str:
    """The symbol of a series name, as data.splits_path lists it: 'prices.csv[AAPL]', 'AAPL.csv', a frame 'AAPL'."""
    if name.endswith("]") and "[" in name:
        return name[name.rindex("[") + 1:-1].upper()
    return (name[:-len(Path(name).suffix)] if Path(name).suffix.lower() in csv_sources.SUFFIXES else name).upper()


def back_adjust(ts: np.ndarray, values: np.ndarray, splits: list[tuple[int, float]], where: str) -> np.ndarray:
    """`values (n, 6)` with each split applied to the bars before its date (`ts (n,)` ns): prices / ratio, volume x
    ratio, amount kept (data.columns.factor's cumulative factor, built from the splits)."""
    values = np.array(values, dtype=np.float64)
    for when, ratio in splits:
        before = ts < when  # (n,) the bars before the ex-date
        values[before, :4] /= ratio
        values[before, 4] *= ratio
    if splits:
        log.info("%s: %d split(s) from data.splits_path applied to the bars before them", where, len(splits))
    return values


def jump_notes(ts: np.ndarray, values: np.ndarray, where: str) -> list[str]:
    """Warnings, with dates, about bar-to-bar moves of a split-like ratio (2, 3, 4, 5, 8, 10 or their inverse,
    close-to-close) that the new bar's own high / low range does not show (an unadjusted split), and about gaps over
    20 bar spacings and 14 days (a series that stopped and restarted). `ts (n,)` ns, `values (n, 6)` open..amount."""
    if len(ts) < 3:
        return []
    close, step = values[:, 3], np.diff(ts)  # (n,), (n - 1,)
    with np.errstate(divide="ignore", invalid="ignore"):  # a price <= 0 is refused by candle_problems
        ratio = np.maximum(close[1:] / close[:-1], close[:-1] / close[1:])  # (n - 1,) >= 1
    split_like = (np.abs(ratio[:, None] / np.array([2, 3, 4, 5, 8, 10]) - 1) < 0.03).any(axis=1)
    calm = values[1:, 1] / values[1:, 2] < 1.5  # the new bar's high / low: no such move inside it
    gap = step > max(20 * np.median(step), pd.Timedelta(days=14).value)
    dates = lambda at: ", ".join(stamp_text(int(ts[i])) for i in (np.flatnonzero(at) + 1)[:5])  # noqa: E731
    return ([f"{where}: the close jumps by a split-like ratio at {dates(split_like & calm)}: prices not adjusted "
             "for a split? give adjusted prices, a splits file (data.splits_path), an adjustment factor column "
             "(data.columns.factor) or data.adjust: adj_close with an adjusted close column"]
            if (split_like & calm).any() else []) + \
        ([f"{where}: {int(gap.sum())} gap(s) of many bar spacings, the bar after each at {dates(gap)}: windows join "
          "the bars across them; data.max_gap_days drops the bars before such a gap"] if gap.any() else [])


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
        raise csv_sources.SourceProblems([(
            f"{where}: {same.size} duplicate timestamp(s), first {pd.Timestamp(first)} at {unit} "
            f"{stamps.listed(lines[ts == first])}; remove the duplicates (or set data.symbol_column "
            "if the file holds several series)")])
    cols = [i for i, p in enumerate(present) if p]
    nan = np.isnan(values[:, cols])  # (n, n_present)
    if nan.any():
        if nan_policy == "error":
            details = [f"column {FEATURES[c]} at {unit} {stamps.listed(lines[nan[:, j]])}"
                       for j, c in enumerate(cols) if nan[:, j].any()]
            raise csv_sources.SourceProblems([f"{where}: missing values in " + "; ".join(details) +
                                  " (data.nan_policy: error; set it to ffill or drop to repair them)"])
        if nan_policy == "ffill":
            if nan[0].any():
                which = ", ".join(FEATURES[c] for j, c in enumerate(cols) if nan[0, j])
                raise csv_sources.SourceProblems([(f"{where}: missing value(s) in the first row ({which}) cannot be "
                                       "forward-filled (data.nan_policy: ffill); fix or drop that row")])
            notes.append(f"{where}: forward-filling {int(nan.sum())} missing value(s) (data.nan_policy: ffill)")
            values = values.copy()
            values[:, cols] = pd.DataFrame(values[:, cols]).ffill().to_numpy()  # row 0 has no NaN (checked above)
        else:
            rows = nan.any(axis=1)
            notes.append(f"{where}: dropping {int(rows.sum())} row(s) with missing values (data.nan_policy: drop)")
            ts, values = ts[~rows], values[~rows]
    if present[4] and not present[5]:
        values = np.array(values, dtype=np.float64, copy=True)
        # The forecaster derives a missing amount the same way, so training and inference see the same features.
        values[:, 5] = fill_amount(*(values[:, i] for i in (4, 0, 1, 2, 3)))  # volume, open, high, low, close
    return ts, values, notes
