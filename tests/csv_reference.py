"""The in-memory pandas loader of CSV candles: an INDEPENDENT REFERENCE for the tests, not production code.

Production reads the prepared store (finetune_csv/prepare.py `prepare_data`); the tests compare the store, its
splits and the held-out windows cut from it with this loader bit for bit (float64 here, float32 in the store). It
implements the same rules in pandas: sorting, duplicates, NaN policy, column mapping, time zones, float32 range.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from finetune.utils.config_utils import Problems
from finetune.utils.fingerprint import file_fingerprint
from finetune_csv.config import DataConfig
from finetune_csv.sources import check_float32_range
from finetune_csv.splits import split_bounds, too_short_problems
from finetune_csv.timestamps import (
    OFFSET_RE,
    CandleDataError,
    check_frequencies,
    check_tz_consistency,
    infer_frequency,
    parse_timestamps,
)
from model.features import FEATURES

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
_MAX_LISTED = 5  # rows quoted per problem: enough to find them, short enough to read


def has_utc_offset(values) -> bool:
    """True when the timestamps carry a UTC offset (tz-aware datetimes, or strings ending in +hh:mm / Z)."""
    s = pd.Series(values)
    if isinstance(s.dtype, pd.DatetimeTZDtype):
        return True
    if pd.api.types.is_datetime64_dtype(s.dtype) or len(s) == 0:
        return False
    return bool(s.astype("string").str.strip().str.extract(OFFSET_RE, expand=True)["off"].notna().any())


@dataclass(frozen=True)
class Series:
    """One time series of candles, oldest first, with unique timestamps."""

    name: str
    """Where it came from: the file name, plus `[symbol]` when a symbol column split the file."""
    source: Path
    """The CSV file it was read from."""
    timestamps: pd.DatetimeIndex
    """(T,) bar times, strictly increasing."""
    values: np.ndarray
    """(T, 6) float64 open, high, low, close, volume, amount."""


@dataclass(frozen=True)
class Segment:
    """The rows of one series that one split may read: its own rows, preceded by context rows for val/test."""

    series: Series
    start: int
    """First row (into the series) a window of this split may read."""
    first_target: int
    """First row that belongs to the split itself; rows before it are context only."""
    stop: int
    """One past the last row of the split."""

    @property
    def values(self) -> np.ndarray:
        """(stop - start, 6) candles of the segment, context included."""
        return self.series.values[self.start : self.stop]

    @property
    def timestamps(self) -> pd.DatetimeIndex:
        """(stop - start,) times of the segment, context included."""
        return self.series.timestamps[self.start : self.stop]


# ----------------------------------------------------------------------------------------------------------------
# Loading


def list_csv_files(path: str | Path) -> list[Path]:
    """The CSV files `data.path` names: the file itself, or the *.csv files of a folder, sorted by name."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() == ".csv")
        others = sorted(f.name for f in p.iterdir() if f.is_file() and f.suffix.lower() != ".csv")
        if others:
            log.info("ignoring %d non-CSV file(s) in %s: %s", len(others), p, ", ".join(others[:_MAX_LISTED]))
        if not files:
            raise ValueError(f"data.path: the folder {p} holds no .csv file")
        return files
    raise ValueError(f"data.path: {p} does not exist (give a CSV file or a folder of CSV files)")


def load_series(cfg: DataConfig) -> list[Series]:
    """Read, check and clean every CSV named by `cfg.path`; raise one ConfigError listing every problem found."""
    problems = Problems("The input data has problems")
    series: list[Series] = []
    aware: dict[str, bool] = {}
    for file in list_csv_files(cfg.path):
        try:
            loaded, aware[file.name] = _load_file(file, cfg)
            series.extend(loaded)
        except _DataProblems as e:
            problems.extend(e.problems)
    try:
        check_tz_consistency(aware)
        check_frequencies({s.name: infer_frequency(s.timestamps, source=s.name) for s in series
                           if len(s.timestamps) >= 2}, getattr(cfg, "frequency", None))
    except CandleDataError as e:
        problems.extend([str(e)])
    problems.raise_if_any()
    names = [s.name for s in series]
    if len(set(names)) != len(names):  # cannot happen with distinct file names; guards future changes
        raise ValueError(f"duplicate series names: {names}")
    return series


class _DataProblems(Exception):
    """Stops reading one file; its problems are collected into the caller's `Problems`."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _load_file(file: Path, cfg: DataConfig) -> tuple[list[Series], bool]:
    try:
        # Strings first: numeric parsing is ours, so a bad cell can be reported with its row and value.
        raw = pd.read_csv(file, dtype=str, keep_default_na=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        raise _DataProblems([f"{file}: the file is empty"]) from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise _DataProblems([f"{file}: not a readable CSV ({e})"]) from None
    if raw.empty:
        raise _DataProblems([f"{file}: the file has a header but no rows"])

    columns = _resolve_columns(list(raw.columns), cfg, file)
    frame = pd.DataFrame(index=raw.index)
    problems: list[str] = []
    frame["timestamps"] = _parse_timestamps(raw[columns["timestamps"]], cfg, file, problems)
    aware = has_utc_offset(raw[columns["timestamps"]])
    for field in FEATURES:
        if columns.get(field) is not None:
            frame[field] = _parse_numbers(raw[columns[field]], field, columns[field], file, problems)
    if not problems:
        present = [f for f in FEATURES if columns.get(f) is not None]
        try:
            check_float32_range(frame[present].to_numpy(dtype=np.float64), [columns[f] for f in present], str(file),
                                first_row=2)
        except CandleDataError as e:
            problems.append(str(e))
    if problems:
        raise _DataProblems(problems)

    if cfg.symbol_column is None:
        groups = [(file.name, frame)]
    else:
        symbols = raw[cfg.symbol_column].str.strip()
        if (symbols == "").any():
            rows = _csv_rows(symbols.index[symbols == ""])
            raise _DataProblems([f"{file}: column '{cfg.symbol_column}' (data.symbol_column) is empty at line(s) "
                                 f"{rows}"])
        groups = [(f"{file.name}[{sym}]", part) for sym, part in frame.groupby(symbols, sort=True)]

    out = []
    for name, part in groups:
        try:
            out.append(_clean_series(name, file, part, columns, cfg))
        except _DataProblems as e:
            problems.extend(e.problems)
    if problems:
        raise _DataProblems(problems)
    return out, aware


def _resolve_columns(header: list[str], cfg: DataConfig, file: Path) -> dict[str, str | None]:
    """Map our field names to the file's column names; missing required columns -> an error with suggestions.

    Optional volume/amount: a column configured as null is absent. A configured name that is missing is absent
    too when the header has nothing like it, but an error when it has a close match (a misspelling must not
    silently turn real volumes into zeros).
    """
    wanted = vars(cfg.columns)
    columns: dict[str, str | None] = {}
    problems = []
    for field, name in wanted.items():
        if name is None or name in header:
            columns[field] = name
            continue
        close = difflib.get_close_matches(name, header, n=1, cutoff=0.6)
        close += [h for h in header if h.lower() == name.lower() and h not in close]
        hint = f"; did you mean '{close[0]}'? (set data.columns.{field}: {close[0]})" if close else ""
        if field in ("volume", "amount") and not close:
            columns[field] = None
            log.info("%s: no '%s' column (data.columns.%s); it will be derived", file.name, name, field)
            continue
        optional = f", or data.columns.{field}: null if the data has none" if field in ("volume", "amount") else ""
        problems.append(f"{file}: column '{name}' (data.columns.{field}) not found{hint}{optional}; "
                        f"the header is {header}")
    if cfg.symbol_column is not None and cfg.symbol_column not in header:
        close = difflib.get_close_matches(cfg.symbol_column, header, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(f"{file}: symbol column '{cfg.symbol_column}' (data.symbol_column) not found{hint}")
    if problems:
        raise _DataProblems(problems)
    if columns["volume"] is None and columns["amount"] is not None:
        raise _DataProblems([f"{file}: has an amount column but no volume column; set data.columns.amount: null "
                             "or map data.columns.volume"])
    return columns


def _parse_timestamps(raw: pd.Series, cfg: DataConfig, file: Path, problems: list[str]) -> pd.Series:
    text = raw.str.strip()
    if has_utc_offset(text):  # the candle-checks rule: local wall-clock time, DST changes, data.timezone
        try:
            return pd.Series(parse_timestamps(text, source=str(file), fmt=cfg.timestamp_format,
                                              timezone=getattr(cfg, "timezone", None), first_row=2), index=raw.index)
        except CandleDataError as e:
            problems.append(str(e))
            return pd.Series(pd.NaT, index=raw.index, dtype="datetime64[ns]")
    ts = pd.to_datetime(text, format=cfg.timestamp_format, errors="coerce")
    bad = ts.isna()
    if bad.any():
        rows = _csv_rows(bad[bad].index)
        examples = ", ".join(repr(v) for v in text[bad].head(3))
        fmt = f"'{cfg.timestamp_format}'" if cfg.timestamp_format else "inferred"
        problems.append(f"{file}: column '{raw.name}' (data.columns.timestamps) has {int(bad.sum())} unparseable "
                        f"timestamp(s) at line(s) {rows}, e.g. {examples} (format {fmt}; set data.timestamp_format)")
    return ts


def _parse_numbers(raw: pd.Series, field: str, column: str, file: Path, problems: list[str]) -> pd.Series:
    text = raw.str.strip()
    # Empty cells and NaN spellings are missing values (handled by data.nan_policy), not bad numbers.
    missing = text.isin(["", "nan", "NaN", "NA", "N/A", "null", "None"])
    values = pd.to_numeric(text.where(~missing), errors="coerce")
    bad = values.isna() & ~missing
    if bad.any():
        rows = _csv_rows(bad[bad].index)
        examples = ", ".join(repr(v) for v in text[bad].head(3))
        problems.append(f"{file}: column '{column}' (data.columns.{field}) has non-numeric value(s) at line(s) "
                        f"{rows}: {examples}")
    inf = np.isinf(values.to_numpy(dtype=np.float64, na_value=np.nan))
    if inf.any():
        problems.append(f"{file}: column '{column}' (data.columns.{field}) has infinite value(s) at line(s) "
                        f"{_csv_rows(values.index[inf])}")
    return values.astype(np.float64)


def _clean_series(name: str, file: Path, frame: pd.DataFrame, columns: dict, cfg: DataConfig) -> Series:
    """Sort, reject duplicates, apply the NaN policy and derive volume/amount for one series."""
    where = f"{file}" if name == file.name else f"{file} (series {name})"
    ts = frame["timestamps"]
    if not ts.is_monotonic_increasing:
        log.warning("%s: timestamps are not sorted; sorting them (rows keep their values)", where)
        frame = frame.sort_values("timestamps", kind="stable")
        ts = frame["timestamps"]
    dup = ts.duplicated(keep=False)
    if dup.any():
        first = ts[dup].iloc[0]
        raise _DataProblems([f"{where}: {int(ts.duplicated().sum())} duplicate timestamp(s), first {first} at line(s) "
                             f"{_csv_rows(ts.index[ts == first])}; remove the duplicates (or set data.symbol_column "
                             "if the file holds several series)"])

    present = [f for f in FEATURES if columns.get(f) is not None]
    frame = _apply_nan_policy(frame, present, columns, cfg.nan_policy, where)
    values = np.zeros((len(frame), len(FEATURES)), dtype=np.float64)  # (T, 6)
    for i, f in enumerate(FEATURES):
        if f in present:
            values[:, i] = frame[f].to_numpy()
    if columns.get("amount") is None and columns.get("volume") is not None:
        # The forecaster derives a missing amount the same way, so training and inference see the same features.
        values[:, 5] = values[:, 4] * values[:, :4].mean(axis=1)
    return Series(name=name, source=file, timestamps=pd.DatetimeIndex(frame["timestamps"]), values=values)


def _apply_nan_policy(frame: pd.DataFrame, present: list[str], columns: dict, policy: str, where: str) -> pd.DataFrame:
    nan = frame[present].isna()
    if not nan.any().any():
        return frame
    if policy == "error":
        details = []
        for f in present:
            if nan[f].any():
                details.append(f"column '{columns[f]}' at line(s) {_csv_rows(frame.index[nan[f].to_numpy()])}")
        raise _DataProblems([f"{where}: missing values in " + "; ".join(details) +
                             " (data.nan_policy: error; set it to ffill or drop to repair them)"])
    if policy == "ffill":
        lead = nan.iloc[0]
        if lead.any():
            cols = [columns[f] for f in present if lead[f]]
            raise _DataProblems([f"{where}: missing value(s) in the first row ({', '.join(cols)}) cannot be "
                                 "forward-filled (data.nan_policy: ffill); fix or drop that row"])
        log.warning("%s: forward-filling %d missing value(s) (data.nan_policy: ffill)", where, int(nan.sum().sum()))
        filled = frame.copy()
        filled[present] = filled[present].ffill()
        return filled
    rows = nan.any(axis=1).to_numpy()
    log.warning("%s: dropping %d row(s) with missing values (data.nan_policy: drop)", where, int(rows.sum()))
    return frame[~rows]


def _csv_rows(index) -> str:
    """Rows as the user sees them in an editor: header is line 1, so data row i is line i + 2."""
    lines = [str(int(i) + 2) for i in list(index)[:_MAX_LISTED]]
    more = len(index) - _MAX_LISTED
    return ", ".join(lines) + (f" (+{more} more)" if more > 0 else "")


# ----------------------------------------------------------------------------------------------------------------
# Splitting


def split_series(series: list[Series], cfg: DataConfig) -> dict[str, list[Segment]]:
    """Cut each series by time into train/val/test segments; too-short series -> one ValueError naming them.

    A val/test segment starts `lookback` rows before its split so that its first window predicts the split's
    first row; windows of a segment never reach into another series.
    """
    too_short_problems([(s.name, len(s.values)) for s in series], cfg).raise_if_any()
    out: dict[str, list[Segment]] = {name: [] for name in SPLITS}
    for s in series:
        n = len(s.values)
        train_end, val_end = split_bounds(n, cfg.train_ratio, cfg.val_ratio)
        out["train"].append(Segment(s, 0, 0, train_end))
        out["val"].append(Segment(s, train_end - cfg.lookback, train_end, val_end))
        if cfg.test_ratio > 0:
            out["test"].append(Segment(s, val_end - cfg.lookback, val_end, n))
    return out


def window_starts(segment: Segment, window: int, stride: int) -> np.ndarray:
    """Start rows (relative to the segment) of every window of `window` rows, `stride` apart."""
    return np.arange(0, len(segment.values) - window + 1, stride, dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------------
# Provenance


def data_summary(series: list[Series], splits: dict[str, list[Segment]], cfg: DataConfig) -> dict:
    """What run_info.json records about the data: files with sha256, and rows and date ranges per split."""
    files = sorted({s.source for s in series})
    window = cfg.lookback + cfg.predict
    per_split = {}
    for name, segments in splits.items():
        if not segments:
            continue
        own = [(seg.series.timestamps[seg.first_target], seg.series.timestamps[seg.stop - 1]) for seg in segments]
        per_split[name] = {
            "rows": int(sum(seg.stop - seg.first_target for seg in segments)),
            "context_rows": int(sum(seg.first_target - seg.start for seg in segments)),
            "windows": int(sum(len(window_starts(seg, window, cfg.stride)) for seg in segments)),
            "start": str(min(a for a, _ in own)),
            "end": str(max(b for _, b in own)),
        }
    return {
        "files": [{k: file_fingerprint(f)[k] for k in ("path", "bytes", "sha256")} for f in files],
        "series": [{"name": s.name, "rows": len(s.values), "start": str(s.timestamps[0]),
                    "end": str(s.timestamps[-1])} for s in series],
        "splits": per_split,
    }



# ----------------------------------------------------------------------------------------------------------------
# Windows cut from the reference segments (what the store's datasets and held-out windows are compared with)


def reference_dataset(segments: list[Segment], cfg: DataConfig):
    """The shared WindowDataset over in-memory copies of `segments` (float32 features, calc_time_stamps stamps)."""
    from finetune.utils.windows import SeriesArrays, WindowDataset
    from model.features import calc_time_stamps

    arrays = [SeriesArrays(features=s.values.astype(np.float32),
                           stamps=calc_time_stamps(s.timestamps).to_numpy(dtype=np.int64), name=s.series.name)
              for s in segments]
    return WindowDataset(arrays, cfg.window, stride=cfg.stride)


def reference_held_out_windows(segments: list[Segment], lookback: int, predict: int, stride: int | None = None,
                               max_windows: int | None = None) -> dict:
    """Every window `stride` rows apart (None = predict) of each segment, optionally capped per series (evenly
    spread, ends included): {"names", "context" (N, L, 6), "actual" (N, P, 6), "x_ts", "y_ts"}, float64."""
    stride = predict if stride is None else stride
    out = {"names": [], "context": [], "actual": [], "x_ts": [], "y_ts": []}
    for seg in segments:
        starts = window_starts(seg, lookback + predict, stride)
        if max_windows is not None and len(starts):
            k = min(max_windows, len(starts))
            starts = starts[np.unique(np.round(np.linspace(0, len(starts) - 1, k)).astype(np.int64))]
        for s in starts:
            out["names"].append(seg.series.name)
            out["context"].append(seg.values[s: s + lookback])
            out["actual"].append(seg.values[s + lookback: s + lookback + predict])
            out["x_ts"].append(seg.timestamps[s: s + lookback])
            out["y_ts"].append(seg.timestamps[s + lookback: s + lookback + predict])
    out["context"] = np.asarray(out["context"], dtype=np.float64).reshape(-1, lookback, 6)
    out["actual"] = np.asarray(out["actual"], dtype=np.float64).reshape(-1, predict, 6)
    return out


def one_series_split(values: np.ndarray, timestamps: pd.DatetimeIndex, start: int, first_target: int, stop: int,
                     name: str = "s.csv"):
    """A one-series in-memory panel (values (n, 6), bar times (n,)) and its split [start, stop) as `PanelSegments`."""
    from finetune.utils.store import SeriesPanel
    from finetune.utils.windows import PanelSegments
    from model.features import calc_time_stamps

    ts = pd.DatetimeIndex(timestamps)
    panel = SeriesPanel.from_series([values], [calc_time_stamps(ts).to_numpy(np.int64)], [name],
                                    [ts.as_unit("ns").asi8])
    as_arr = lambda v: np.array([v], dtype=np.int64)
    return PanelSegments(panel, as_arr(start), as_arr(first_target), as_arr(stop))


def candles(n: int, start: str = "2024-01-02 09:30", seed: int = 0, **extra) -> pd.DataFrame:
    """n 5-minute candles of a random walk (test data); `extra` adds columns."""
    rng = np.random.default_rng(seed)
    close = 100 + np.cumsum(rng.normal(0, 0.5, n))
    frame = pd.DataFrame({
        "timestamps": pd.date_range(start, periods=n, freq="5min"),
        "open": close + rng.normal(0, 0.1, n), "high": close + 1.0, "low": close - 1.0, "close": close,
        "volume": rng.uniform(100, 200, n), "amount": rng.uniform(1e4, 2e4, n),
    })
    for k, v in extra.items():
        frame[k] = v
    return frame
