"""Read one CSV or Parquet file of candles in blocks, parsed and checked cell by cell, never holding the whole file.

    reader = SourceReader(path, settings)     # resolves the column mapping (raises SourceProblems)
    for block in reader.blocks():             # ParsedBlock per ~block_rows rows
        block.timestamps, block.values, block.lines, block.symbols
    reader.problems                           # every bad cell found, one message per (column, kind)

The cell rules are the CSV pipeline's (tests/csv_reference.py holds an independent pandas version), so a store
prepared from a file holds exactly what that pipeline would load: cells are stripped; '', nan, NaN, NA, N/A, null
and None are missing values (the NaN policy handles them later); any other non-number is an error naming the file,
the column, the line and the setting; infinite values and values beyond float32's range are errors. Timestamps
become naive wall-clock nanoseconds by the rule of finetune/utils/data/candle_checks.py (the one implementation both data
paths use): a stamp with a UTC offset keeps the wall-clock time it states, or is converted to `timezone`
(data.timezone) when set; a file mixing stamps with and without offsets is an error. An unnamed first column (what
`DataFrame.to_csv` writes for the index) whose first value parses as a date is taken as the timestamps when the
configured timestamps column is missing.

Speed: the common cases (ISO timestamps, plain decimal numbers) are parsed by Arrow compute kernels; a block where
Arrow refuses a cell, or where the timestamp format is set, is re-parsed with the pandas routines the CSV pipeline
uses, which also finds the exact rows to report.

(Over 400 lines on purpose: the column mapping, the cell rules and the problem messages of one reader stay together,
so the CSV and Parquet paths cannot drift apart.)
"""

from __future__ import annotations

import csv
import difflib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from model.features import FEATURES

from .candle_checks import (
    _OFFSET_RE,
    CandleDataError,
    check_float32_range,
    parse_timestamps,
)

log = logging.getLogger(__name__)

__all__ = [
    "CSV_SUFFIXES",
    "FEATURES",
    "MISSING_SPELLINGS",
    "PARQUET_SUFFIXES",
    "ParsedBlock",
    "SourceProblems",
    "SourceReader",
]

MISSING_SPELLINGS = ("", "nan", "NaN", "NA", "N/A", "null", "None")
CSV_SUFFIXES = (".csv",)
PARQUET_SUFFIXES = (".parquet", ".pq")
_MAX_LISTED = 5  # rows quoted per problem
_MISSING = pa.array(MISSING_SPELLINGS, pa.string())


class SourceProblems(ValueError):
    """Problems of one input file (each message names file, column, row and the setting to change)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class ParsedBlock:
    """Consecutive rows of one file, parsed."""

    lines: np.ndarray
    """(n,) int64 where each row is in the file as a user finds it (CSV: line number, header = 1;
    Parquet: row, 1-based)."""
    timestamps: np.ndarray
    """(n,) int64 naive wall-clock nanoseconds since 1970-01-01."""
    values: np.ndarray
    """(n, 6) float64 open..amount; NaN = missing cell; a column the file does not have is 0."""
    symbols: np.ndarray | None
    """(n,) int32 index into `SourceReader.symbols`, or None without a symbol column."""


@dataclass
class _Issue:
    count: int = 0
    rows: list[int] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    def add(self, rows: np.ndarray, examples: list[str] | None = None) -> None:
        self.count += len(rows)
        room = _MAX_LISTED - len(self.rows)
        if room > 0:
            self.rows.extend(int(r) for r in rows[:room])
        if examples and len(self.examples) < 3:
            self.examples.extend(examples[: 3 - len(self.examples)])

    def where(self) -> str:
        more = self.count - len(self.rows)
        return ", ".join(map(str, self.rows)) + (f" (+{more} more)" if more > 0 else "")


class SourceReader:
    """One input file: the column mapping resolved against its header, then its rows in parsed blocks.

    Args:
        path: a .csv or .parquet/.pq file.
        columns: our field name (timestamps, open, ..., amount) -> the file's column name (None = absent).
        symbol_column: column whose values split the file into series, or None.
        timestamp_format: strftime format of text timestamps, or None to infer.
        block_rows: rows per block (memory per block is about 100 bytes a row).
    Raises SourceProblems when the file cannot be read or a mapped column is missing.
    """

    def __init__(self, path: str | Path, columns: Mapping[str, str | None], symbol_column: str | None = None,
                 timestamp_format: str | None = None, block_rows: int = 1 << 20, timezone: str | None = None):
        self.path = Path(path)
        self.symbol_column = symbol_column
        self.timestamp_format = timestamp_format
        self.timezone = timezone
        self.tz_aware: bool | None = None
        """Whether this file's stamps carry a UTC offset (known after the first block)."""
        self._messages: list[str] = []  # whole-message problems (candle checks), beside the per-cell issues
        self.block_rows = int(block_rows)
        self.is_parquet = self.path.suffix.lower() in PARQUET_SUFFIXES
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
            self.columns = _resolve_columns(header, columns, symbol_column, self.path)
        except SourceProblems as e:
            if self._unnamed_hint is not None:  # e.g. a to_csv index of numbers: say what the unnamed column is
                e.problems[:] = [p + (f"; the first column has no header (read as '{self._unnamed_hint}'): if it "
                                      f"holds the timestamps set data.columns.timestamps: '{self._unnamed_hint}', "
                                      "else give it a name in the file"
                                      if "(data.columns.timestamps) not found" in p else "") for p in e.problems]
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
            out.append(_ISSUE_TEXT[kind].format(file=self.path, column=column, field=self._field_of(column),
                                                n=issue.count, where=f"{self.unit} {issue.where()}",
                                                examples=", ".join(issue.examples), fmt=self._fmt_text(),
                                                symbol=self.symbol_column))
        return out + self._messages

    def blocks(self) -> Iterator[ParsedBlock]:
        """Parsed blocks in file order; cells with problems are recorded in `problems` (their values are NaN/0)."""
        batches = self._parquet_batches() if self.is_parquet else self._csv_batches()
        first = 2 if not self.is_parquet else 1  # line/row number of the first data row
        for batch in batches:
            n = batch.num_rows
            if n == 0:
                continue
            lines = np.arange(first + self.n_rows, first + self.n_rows + n, dtype=np.int64)
            self.n_rows += n
            yield self._parse(batch, lines)
        if self.n_rows == 0:
            raise SourceProblems([f"{self.path}: the file has a header but no rows"])

    # ------------------------------------------------------------------------------------------------------------
    def _adopt_unnamed_index(self, header: list[str], columns: dict[str, str | None]) -> dict[str, str | None]:
        """Take an unnamed first column (DataFrame.to_csv's index: 'Unnamed: 0'; Parquet: '__index_level_0__') as
        the timestamps when the configured timestamps column is missing and its first value reads as a date."""
        wanted = columns.get("timestamps", "timestamps")
        if wanted in header or not header or header[0] not in ("Unnamed: 0", "__index_level_0__"):
            return columns
        first = self._first_value(header[0])
        try:
            ok = first is not None and not pd.isna(pd.to_datetime(first, format=self.timestamp_format))
        except (ValueError, TypeError, OverflowError):
            ok = False
        if ok:
            log.info("%s: no '%s' column; taking the unnamed first column (e.g. %r) as the timestamps "
                     "(set data.columns.timestamps to name another column)", self.path.name, wanted, first)
            return {**columns, "timestamps": header[0]}
        self._unnamed_hint = header[0]
        return columns

    def _first_value(self, column: str):
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
        try:
            self._pq = pq.ParquetFile(self.path)
        except (pa.ArrowInvalid, OSError) as e:
            raise SourceProblems([f"{self.path}: not a readable Parquet file ({e})"]) from None
        return list(self._pq.schema_arrow.names)

    def _parquet_batches(self) -> Iterator[pa.RecordBatch]:
        wanted = list(dict.fromkeys([c for c in self.columns.values() if c is not None]
                                    + ([self.symbol_column] if self.symbol_column else [])))
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
        if not any(m.startswith((f"{self.path} line", f"{self.path} row")) for m in self._messages):
            try:  # the first out-of-range value of the file is reported (one message per file)
                check_float32_range(values, [self.columns.get(f) or f for f in FEATURES], str(self.path),
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
                f"{self.path}: some timestamps carry a UTC offset and some do not (the change is near {self.unit} "
                f"{int(lines[0])}); write all of them with an offset or none")

    def _timestamps_with_offsets(self, text: np.ndarray, lines: np.ndarray) -> np.ndarray:
        """Offset-carrying text stamps -> naive wall-clock ns (candle_checks.parse_timestamps: DST changes, zone)."""
        fmt = self.timestamp_format
        if fmt is None and len(text):
            if self._guessed_format is None:
                self._guessed_format = pd.tseries.api.guess_datetime_format(str(text[0])) or ""
            fmt = self._guessed_format or None
        try:
            idx = parse_timestamps(text, source=str(self.path), fmt=fmt, timezone=self.timezone,
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

    def _timestamps_pandas(self, text: np.ndarray, lines: np.ndarray, name: str) -> np.ndarray:
        fmt = self.timestamp_format
        if fmt is None:
            # pandas infers a format from the first value of the file (as the CSV pipeline's one call does).
            if self._guessed_format is None and len(text):
                self._guessed_format = pd.tseries.api.guess_datetime_format(str(text[0])) or ""
            fmt = self._guessed_format or None
        s = pd.Series(text, dtype=object)
        try:
            ts = pd.to_datetime(s, format=fmt, errors="coerce")
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


def _resolve_columns(header: list[str], wanted: dict[str, str | None], symbol_column: str | None,
                     file: Path) -> dict[str, str | None]:
    """Our field -> the file's column (the CSV pipeline's rules): a missing required column is an error with a
    suggestion; a missing volume/amount is absent unless the header has a close match (a misspelling must not
    silently turn real volumes into zeros)."""
    header = _unique(header)
    columns: dict[str, str | None] = {}
    problems = []
    for fld in ("timestamps",) + FEATURES:
        name = wanted.get(fld, fld)
        if name is None or name in header:
            columns[fld] = name
            continue
        close = difflib.get_close_matches(name, header, n=1, cutoff=0.6)
        close += [h for h in header if h.lower() == name.lower() and h not in close]
        hint = f"; did you mean '{close[0]}'? (set data.columns.{fld}: {close[0]})" if close else ""
        if fld in ("volume", "amount") and not close:
            columns[fld] = None
            log.info("%s: no '%s' column (data.columns.%s); it will be derived", file.name, name, fld)
            continue
        optional = f", or data.columns.{fld}: null if the data has none" if fld in ("volume", "amount") else ""
        problems.append(f"{file}: column '{name}' (data.columns.{fld}) not found{hint}{optional}; "
                        f"the header is {header}")
    if symbol_column is not None and symbol_column not in header:
        close = difflib.get_close_matches(symbol_column, header, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(f"{file}: symbol column '{symbol_column}' (data.symbol_column) not found{hint}")
    if problems:
        raise SourceProblems(problems)
    if columns["volume"] is None and columns["amount"] is not None:
        raise SourceProblems([(f"{file}: has an amount column but no volume column; set data.columns.amount: "
                               "null or map data.columns.volume")])
    return columns
