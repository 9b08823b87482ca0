"""Reading the input: CSV/Parquet files (or DataFrames from Python) -> columns resolved -> cells parsed and checked
in blocks -> one series at a time (`list_sources`, `SourceReader`, `file_series`). Each step's rules:
docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import csv
import difflib
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.feather as feather
import pyarrow.parquet as pq

from finetune.utils.errors import StoreError
from finetune.utils.fingerprint import file_fingerprint
from finetune_csv.timestamps import OFFSET_RE, SHOWN, CandleDataError, parse_timestamps
from model.features import (
    CANDLE_COLUMNS,
    COLUMN_ALIASES,
    FEATURES,
    FLOAT32_RULE,
    ColumnError,
    adj_close_column,
    adjust_prices,
    float32_lost,
    resolve_columns,
    timestamp_parts,
)
from model.frames import epoch_unit

FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4028235e+38

log = logging.getLogger(__name__)

MISSING_SPELLINGS = ("", "nan", "NaN", "NA", "N/A", "null", "None")
CSV_SUFFIXES = (".csv",)
PARQUET_SUFFIXES = (".parquet", ".pq")
TABLE_SUFFIXES = (".feather", ".arrow", ".json")  # read whole into Arrow: Feather, exchange JSON [[ms, o, h, l, c, v]]
SUFFIXES = CSV_SUFFIXES + PARQUET_SUFFIXES + TABLE_SUFFIXES
_MISSING = pa.array(MISSING_SPELLINGS, pa.string())


class SourceProblems(ValueError):
    """Problems of one input file (each message names file, column, row and the setting to change)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


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


Sources = str | Path | Sequence[str | Path] | Mapping[str, pd.DataFrame]


def list_sources(sources: Sources) -> list[Path | Frame]:
    """Input files: a file of SUFFIXES, a folder (its files of SUFFIXES, sorted by name; an entry that is not a
    readable regular file, e.g. a dangling link or a FIFO, is an error naming it), or a list of them; or
    {name: DataFrame} from Python (one Frame each, in the mapping's order)."""
    if isinstance(sources, Mapping):
        bad = [str(k) for k, v in sources.items() if not isinstance(v, pd.DataFrame)]
        if not sources or bad:
            raise StoreError(f"data: give a DataFrame, a dict {{name: DataFrame}} or a path (not a DataFrame: {bad})")
        return [Frame(str(k), v) for k, v in sources.items()]
    if isinstance(sources, (str, Path)):
        sources = [sources]
    suffixes, kinds = SUFFIXES, "a .csv, .parquet, .feather or .json"
    out: list[Path] = []
    for src in sources:
        if isinstance(src, Frame):  # already listed (prepare_store called by ensure_store)
            out.append(src)
            continue
        p = Path(src)
        if p.is_file():
            if p.suffix.lower() not in suffixes:
                raise StoreError(f"data.path: {p} is not {kinds} file")
            out.append(p)
        elif p.is_dir():
            # A folder named like a data file (Spark writes prices.csv/ as a folder of parts) is not read either.
            odd = sorted(f.name for f in p.iterdir() if not f.name.startswith(".")
                         and not (f.is_dir() and f.suffix.lower() not in suffixes)
                         and not (f.is_file() and os.access(f, os.R_OK)))
            if odd:
                raise StoreError(f"data.path: {p} holds entries that are not readable regular files (a dangling "
                                 f"link, a FIFO, a folder named like a data file, no read permission): {odd[:5]}; "
                                 "remove or fix them")
            files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in suffixes)
            others = sorted(f.name for f in p.iterdir() if f.is_file() and f.suffix.lower() not in suffixes
                            and not f.name.startswith("."))
            if others:
                log.info("ignoring %d file(s) in %s that are not %s files: %s", len(others), p, suffixes,
                         ", ".join(others[:5]) + (" ..." if len(others) > 5 else ""))
            if not files:
                raise StoreError(f"data.path: the folder {p} holds no {kinds.removeprefix('a ')} file")
            out.extend(files)
        else:
            raise StoreError(f"data.path: {p} does not exist or is not a regular file (give a file or a folder of "
                             "CSV/Parquet/Feather/JSON files)")
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise StoreError(f"data.path: two input files share a name (series are named by file): {sorted(names)}")
    return out


def read_table(path: Path, label: str) -> pa.Table:
    """A Feather file, or a JSON file of an exchange's candle arrays ([[ms, open, high, low, close, volume, ...], ...]:
    the first six fields, prices as numbers or text), as Arrow; SourceProblems otherwise."""
    try:
        if path.suffix.lower() != ".json":
            return feather.read_table(path)
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not (isinstance(rows, list) and rows and all(isinstance(r, list) and len(r) >= 6 for r in rows)):
            raise ValueError("expected a non-empty array of [time, open, high, low, close, volume, ...] arrays")
        return pa.table({n: _arrow_column(list(c)) for n, c in zip(CANDLE_COLUMNS[:6], zip(*(r[:6] for r in rows)))})
    except (pa.ArrowException, ValueError, OSError, TypeError) as e:
        raise SourceProblems([f"{label}: not a readable {path.suffix} table of candles ({e})"]) from None


def _arrow_column(values: list) -> pa.Array:
    """JSON values as one Arrow column: numbers as numbers, else all as text (read like a CSV's cells)."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else str(v) for v in values])


def source_fingerprint(source: Path | Frame, with_hash: bool = True) -> dict[str, Any]:
    """A file's `file_fingerprint` or a Frame's content hash: what the store records to tell a changed source."""
    return source.fingerprint() if isinstance(source, Frame) else file_fingerprint(source, with_hash)


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
        room = SHOWN - len(self.rows)
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
                 timestamp_format: str | None = None, block_rows: int = 1 << 20, timezone: str | None = None,
                 adjust: str = "none", shown_as: str | Path | Frame | None = None, timestamp_unit: str | None = None,
                 header: str = "first_row"):
        self._table = path.table() if isinstance(path, Frame) else None  # a DataFrame from Python, as Arrow
        if not isinstance(path, Frame) and Path(path).suffix.lower() in TABLE_SUFFIXES:
            self._table = read_table(Path(path), str(shown_as or path))
        self.path = None if isinstance(path, Frame) else Path(path)
        self.name = path.name if isinstance(path, Frame) else self.path.name  # series name; symbols append to it
        # What every message and log line calls it: `frame 'AAPL'`, or the file: `shown_as` when `path` is the
        # store's snapshot of the user's file.
        self.label = f"frame '{path.name}'" if isinstance(path, Frame) else str(shown_as or self.path)
        self.symbol_column = symbol_column
        self.timestamp_format = timestamp_format
        self.timestamp_unit = timestamp_unit  # data.timestamp_unit: integers are epoch times in it (None: magnitude)
        self.timezone = timezone
        self.tz_aware: bool | None = None  # whether the stamps carry a UTC offset (known after the first block)
        self.zone: str | None = None  # the zone of the stored wall clock when they do and it is one (--future's)
        self._messages: list[str] = []  # whole-message problems (candle checks), beside the per-cell issues
        self.block_rows = int(block_rows)
        self.is_parquet = self._table is not None or self.path.suffix.lower() in PARQUET_SUFFIXES
        self.unit = "row(s)" if self.is_parquet else "line(s)"
        self.symbols: list[str] = []
        self._symbol_codes: dict[str, int] = {}
        self._issues: dict[tuple[str, str], _Issue] = {}
        self._guessed_format: str | None = None
        self.n_rows = 0
        self.headerless = header == "none" and not self.is_parquet  # data.header: none (CSV): columns 0, 1, ...
        header = self._parquet_header() if self.is_parquet else self._csv_header()
        self._unnamed_hint: str | None = None
        columns = {f: None if c is None else str(c) for f, c in columns.items()}  # a position: 0 -> '0'
        factor = columns.pop("factor", None)
        columns = self._adopt_unnamed_index(header, columns)
        self.adj_close = adj_close_column(header)  # named by a candle refusal as data.adjust: adj_close
        self.adjust = adjust
        if adjust == "adj_close" and (self.adj_close is None or columns.get("close") == self.adj_close):
            raise SourceProblems([f"{self.label}: data.adjust: adj_close needs an 'Adj Close' column beside the "
                                  f"close (columns: {header[:12]}); map data.columns.close to the unadjusted close"])
        try:
            self._ts_parts = timestamp_parts(header, columns.get("timestamps", "timestamps"))
        except ColumnError as e:
            raise SourceProblems([f"{self.label}: {e} (data.columns.timestamps)"]) from None
        if self._ts_parts:  # resolved as the date column; read as the parts joined by a space ('Date+Time')
            columns["timestamps"] = self._ts_parts[0]
            log.info("%s: timestamps are the columns %s joined (data.columns.timestamps: %s)", self.name,
                     self._ts_parts, "+".join(self._ts_parts))
        try:
            self.columns = _resolve_columns(header, columns, symbol_column, self.label)
            if self._ts_parts:
                self.columns["timestamps"] = "+".join(self._ts_parts)
            if factor is not None and factor not in header:
                raise SourceProblems([f"{self.label}: no column '{factor}' (data.columns.factor); columns: "
                                      f"{header[:12]}"])
            self.columns["factor"] = factor
        except SourceProblems as e:
            if not self.is_parquet and not self.headerless and _looks_like_data(header):
                raise SourceProblems([f"{self.label}: the file seems to have no header row (its first line reads as "
                                      f"data: {header[:6]}); set data.header: none and map the columns by position "
                                      "with data.columns (e.g. timestamps: 0, open: 1, high: 2, low: 3, close: 4, "
                                      "volume: 5, amount: null)"]) from None
            if self._unnamed_hint is not None:  # e.g. a to_csv index of numbers: say what the unnamed column is
                e.problems[:] = [p + (f"; the first column has no header (read as '{self._unnamed_hint}'): if it "
                                      f"holds the timestamps set data.columns.timestamps: '{self._unnamed_hint}', "
                                      "else give it a name in the file"
                                      if "timestamps" in p else "") for p in e.problems]
            raise

    @property
    def present(self) -> tuple[bool, ...]:
        """Per feature: whether the file has that column."""
        return tuple(self.columns.get(f) is not None for f in FEATURES)

    @property
    def problems(self) -> list[str]:
        """Every problem found so far, one message per (column, kind)."""
        fmt = f"'{self.timestamp_format}'" if self.timestamp_format else "inferred"
        return [_ISSUE_TEXT[kind].format(file=self.label, column=column, field=self._field_of(column), n=issue.count,
                                         where=f"{self.unit} {issue.where()}", examples=", ".join(issue.examples),
                                         fmt=fmt, symbol=self.symbol_column)
                for (kind, column), issue in self._issues.items()] + self._messages

    def blocks(self) -> Iterator[ParsedBlock]:
        """Parsed blocks in file order; cells with problems are recorded in `problems` (their values are NaN/0)."""
        batches = self._parquet_batches() if self.is_parquet else self._csv_batches()
        first = 1 if self.is_parquet or self.headerless else 2  # line/row number of the first data row
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
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
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
        # data.header: none names the columns by position; else an empty cell gets pandas' name
        row = [str(i) if self.headerless else c if c != "" else f"Unnamed: {i}" for i, c in enumerate(row)]
        self._header = row
        return row

    def _wanted(self) -> list[str]:
        """The source columns read: the mapped ones (a joined 'Date+Time' as its parts) and the symbol column, each
        once."""
        return list(dict.fromkeys([c for f, c in self.columns.items()
                                   if c is not None and not (f == "timestamps" and self._ts_parts)]
                                  + (self._ts_parts or []) + ([self.adj_close] if self.adjust == "adj_close" else [])
                                  + ([self.symbol_column] if self.symbol_column else [])))

    def _csv_batches(self) -> Iterator[pa.RecordBatch]:
        wanted = self._wanted()
        # Column names come from our header read (leading spaces stripped, as pandas' skipinitialspace does).
        names = _unique(self._header)
        opts = pa_csv.ReadOptions(column_names=names, skip_rows=int(not self.headerless),
                                  block_size=max(1 << 16, self.block_rows * 64))
        conv = pa_csv.ConvertOptions(include_columns=wanted, column_types={c: pa.string() for c in wanted},
                                     strings_can_be_null=False, quoted_strings_can_be_null=False)
        try:
            reader = pa_csv.open_csv(self.path, read_options=opts, convert_options=conv)
            for batch in reader:
                for start in range(0, batch.num_rows, self.block_rows):
                    yield batch.slice(start, self.block_rows)
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
        wanted = self._wanted()
        if self._table is not None:
            yield from self._table.select(wanted).to_batches(max_chunksize=self.block_rows)
            return
        try:
            yield from self._pq.iter_batches(batch_size=self.block_rows, columns=wanted)
        except (pa.ArrowInvalid, OSError) as e:
            raise SourceProblems([f"{self.path}: not a readable Parquet file ({e})"]) from None

    def _parse(self, batch: pa.RecordBatch, lines: np.ndarray) -> ParsedBlock:
        n = batch.num_rows
        if self._ts_parts:  # (n,) text '<date> <time>'
            stamps = pc.binary_join_element_wise(*[pc.cast(batch.column(c), pa.string()) for c in self._ts_parts], " ")
        else:
            stamps = batch.column(self.columns["timestamps"])
        ts = self._parse_timestamps(stamps, lines)
        values = np.zeros((n, len(FEATURES)), dtype=np.float64)  # (n, 6)
        for i, f in enumerate(FEATURES):
            col = self.columns.get(f)
            if col is not None:
                values[:, i] = self._parse_numbers(batch.column(col), col, lines)
        if self.adjust == "adj_close":
            values = adjust_prices(values, self._parse_numbers(batch.column(self.adj_close), self.adj_close, lines))
        if self.columns["factor"] is not None:  # back-adjusted as Qlib's $factor: prices x factor, volume / factor
            factor = self._parse_numbers(batch.column(self.columns["factor"]), self.columns["factor"], lines)  # (n,)
            bad = ~(factor > 0) & ~np.isinf(factor)  # NaN (missing), 0 or negative; infinite ones are named apart
            if bad.any():
                self._issue("factor", self.columns["factor"], lines[bad], [repr(v) for v in factor[bad][:3]])
            values[:, :4] *= factor[:, None]
            values[:, 4] /= np.where(bad, 1.0, factor)
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
                    self.zone = self.timezone or t.tz
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
        text = pc.utf8_trim_whitespace(col) if pa.types.is_string(t) or pa.types.is_large_string(t) else None
        if pa.types.is_integer(t) or (text is not None and self.timestamp_format is None and len(text)  # digits only:
                                      and str(text[0]).lstrip("-").isdigit()  # the first, then all (cheap on ISO)
                                      and pc.all(pc.match_substring_regex(text, r"^-?\d+$")).as_py()):
            ints = pc.cast(col if text is None else text, pa.int64()).to_numpy(zero_copy_only=False)  # (n,)
            unit = epoch_unit(ints, self.timestamp_unit, f"{self.label}: data.timestamp_unit")
            if unit is not None:
                return self._epoch_ns(ints, unit, lines, name)
            text = pc.cast(col, pa.string()) if text is None else text  # e.g. 20240102: a date, read as text
        if text is None:
            self._issue("ts_type", name, lines[:1], [str(t)])
            return np.zeros(len(col), dtype=np.int64)
        if self.timestamp_format is None:
            try:
                ns = self._iso_ns(text, lines, name)
                self._note_aware(False, lines)
                return ns
            except pa.ArrowInvalid:
                pass
        aware = pc.any(pc.match_substring_regex(text, OFFSET_RE)).as_py() or False
        if aware or self.tz_aware:
            return self._timestamps_with_offsets(text.to_numpy(zero_copy_only=False), lines)
        self._note_aware(False, lines)
        return self._timestamps_pandas(text.to_numpy(zero_copy_only=False), lines, name)

    def _iso_ns(self, text: pa.Array, lines: np.ndarray, name: str) -> np.ndarray:
        """ISO 8601 naive text -> (n,) int64 ns; ArrowInvalid when not ISO. Parsed at microseconds first (straight to
        ns a year 2300 wraps to 1715) so times outside 1677-2262 are named; nanosecond digits parse as ns."""
        try:
            us = pc.cast(text, pa.timestamp("us"))
        except pa.ArrowInvalid:  # e.g. nanosecond digits: too fine for us, so within 1677-2262 is not checked
            return self._ns(pc.cast(text, pa.timestamp("ns")), lines, name)
        ints = pc.fill_null(us.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)  # (n,) microseconds
        outside = (ints < pd.Timestamp.min.value // 1000) | (ints > pd.Timestamp.max.value // 1000)
        if outside.any():
            self._issue("ts_range", name, lines[outside], [repr(v.as_py()) for v in text.filter(outside)[:3]])
            us = pc.if_else(pa.array(outside), pa.scalar(0, us.type), us)
        return self._ns(pc.cast(us, pa.timestamp("ns")), lines, name)

    def _epoch_ns(self, ints: np.ndarray, unit: str, lines: np.ndarray, name: str) -> np.ndarray:
        """Epoch integers (UTC instants) -> naive wall-clock ns in data.timezone (else UTC); a file of them counts as
        one whose stamps carry an offset."""
        try:
            utc = pd.to_datetime(ints, unit=unit, utc=True).as_unit("ns")
        except (OverflowError, pd.errors.OutOfBoundsDatetime, ValueError):
            self._issue("ts_range", name, lines[:1], [f"{ints[0]} ({unit}; data.timestamp_unit)"])
            return np.zeros(len(ints), dtype=np.int64)
        if self.tz_aware is None:
            log.info("%s: integer timestamps read as epoch %s (UTC; data.timestamp_unit sets the unit)", self.label,
                     unit)
        self._note_aware(True, lines)
        self.zone = self.timezone or "UTC"
        return (utc.tz_convert(self.timezone) if self.timezone else utc).tz_localize(None).asi8.copy()

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
        utc = pc.all(pc.match_substring_regex(pa.array(text), r"([Zz]|[+-]00:?00)$")).as_py()  # offsets all zero
        self.zone = self.timezone or ("UTC" if utc and self.zone in (None, "UTC") else "")  # "": none
        return idx.asi8.copy()

    def _ns(self, arr: pa.Array, lines: np.ndarray, name: str) -> np.ndarray:
        if arr.null_count:
            self._issue("ts_bad", name, lines[arr.is_null().to_numpy(zero_copy_only=False)], ["<empty>"])
        return pc.fill_null(arr.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)

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
            with warnings.catch_warnings():  # "could not infer format": the problem recorded below says more
                warnings.simplefilter("ignore", UserWarning)
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
        return next((f for f, c in self.columns.items() if c == column), "symbol_column")


_ISSUE_TEXT = {
    "not_number": (
        "{file}: column '{column}' (data.columns.{field}) has {n} non-numeric value(s) at {where}: {examples}"
    ),
    "inf": "{file}: column '{column}' (data.columns.{field}) has {n} infinite value(s) at {where}",
    "numeric_type": "{file}: column '{column}' (data.columns.{field}) holds {examples}, not numbers",
    "ts_bad": "{file}: column '{column}' (data.columns.timestamps) has {n} unparseable timestamp(s) at {where}, e.g. "
              "{examples} (format {fmt}; set data.timestamp_format, or data.timestamp_unit for epoch integers)",
    "ts_type": "{file}: column '{column}' (data.columns.timestamps) holds {examples}, not timestamps or text; "
               "store the column as timestamps or strings",
    "ts_range": "{file}: column '{column}' (data.columns.timestamps) has {n} time(s) outside 1677-2262, which "
                "nanosecond timestamps cannot hold, at {where}: {examples}",
    "ts_mixed": "{file}: column '{column}' (data.columns.timestamps) cannot be parsed as one series of times near "
                "{where} ({examples}); use one time zone and format (data.timestamp_format)",
    "symbol_empty": "{file}: column '{symbol}' (data.symbol_column) is empty at {where}",
    "factor": "{file}: column '{column}' (data.columns.factor) has {n} adjustment factor(s) that are not finite and "
              "> 0 at {where}: {examples}",
}


def _looks_like_data(header: list[str]) -> bool:
    """Whether a header row reads as a row of values (numbers, dates such as 20131001 or 2024-01-02): no names."""
    def value(cell: str) -> bool:
        try:
            return float(cell) is not None
        except ValueError:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return any(ch.isdigit() for ch in cell) and not pd.isna(pd.to_datetime(cell, errors="coerce"))
    return sum(value(c.strip()) for c in header) >= max(2, len(header) // 2)


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
        problems.append(f"{source}: symbol column '{symbol_column}' (data.symbol_column) not found{hint}; columns: "
                        f"{header[:12]}{' ...' if len(header) > 12 else ''}")
    if problems:
        raise SourceProblems(problems)
    if columns["volume"] is None and columns["amount"] is not None:
        raise SourceProblems([(f"{source}: has an amount column but no volume column; set data.columns.amount: "
                               "null or map data.columns.volume")])
    return columns


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


def file_series(reader: SourceReader, scratch: Path, block_rows: int) -> Iterator[tuple]:
    """Yield (name, timestamps (n,) int64, values (n, 6) float64, lines (n,) int64) per series of one file, in the
    CSV pipeline's order: the file as one series, or one per symbol sorted by symbol name, rows of a symbol in file
    order (grouped through scratch files in `scratch`, removed at the end)."""
    if reader.symbol_column is None:
        parts = list(reader.blocks())
        if reader.problems:
            raise SourceProblems(reader.problems)
        yield (reader.name, np.concatenate([b.timestamps for b in parts]),
               np.concatenate([b.values for b in parts]), np.concatenate([b.lines for b in parts]))
        return
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


class Float32RangeError(CandleDataError):
    """A value float32 does not keep (`model.features.float32_lost`), or an infinite one."""


def check_float32_range(array: Any, columns: Sequence[str], source: str, first_row: int = 1) -> None:
    """Raise `Float32RangeError` at the first value (row-major) of `array (N, C)` or `(N,)` that float32 does not keep
    (`float32_lost`) or that is infinite (NaN is the missing-value policy's); `first_row` is the file line of row 0."""
    a = np.asarray(array, dtype=np.float64).reshape(len(array), -1)  # (N, C)
    bad = float32_lost(a) | np.isinf(a)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        more = f" ({int(bad.sum())} such values in this file)" if bad.sum() > 1 else ""
        raise Float32RangeError(
            f"{source} line {first_row + row}, column '{columns[col]}': value {a[row, col]:.6g} is a value "
            f"{FLOAT32_RULE}{more}; correct or remove it in the file, or rescale that column (e.g. quote the prices "
            "in a smaller unit)")
