"""Build a Qlib provider folder (daily bars) from per-symbol OHLCV(A) tables: the layout Qlib reads, its fields,
suspensions, survivorship and the equal-weighted substitute benchmark are in docs/CONTRACTS.md, "File formats:
Qlib provider folder". The folder is assembled in a temporary sibling and renamed into place."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from finetune.synthetic import generate_ohlcv
from finetune.utils.errors import setup_logging
from model.errors import DataError
from model.features import ColumnError, fill_amount, resolve_columns
from model.fileio import atomic_dir, write_json

USAGE = """Build a Qlib provider folder (daily bars) from per-symbol CSVs, or from synthetic daily data in one command.

    kronos build-qlib-store --csv-dir data/daily_csv --out data/qlib_cn --universe csi300 --benchmark SH000300
    kronos build-qlib-store --synthetic 20 --out data/qlib_demo  # demo store, 2018-01-02..2025-06-30

CSV columns: timestamps, open, high, low, close, volume and optionally amount (derived as volume * mean(open, high,
low, close) when absent), matched in any case with the usual aliases (Date, Datetime, vol, turnover, ...);
--columns timestamps=Trade Date,close=Adj Close maps other names. The symbol is the file stem, upper-cased.
Days with zero volume or no close are written as suspended (NaN in every field); the count per symbol is printed.
--membership FILE (CSV symbol,start,end; several rows per symbol allowed) writes the universe point in time, as it
was on each day, instead of every stock over its whole life (which biases a backtest towards survivors).
Without <BENCHMARK>.csv the benchmark is an equal-weighted index of the universe, and a warning says so.
Read it back with `qlib.init(provider_uri=OUT, region="cn")`; see finetune/qlib_builder.py for the layout.
"""

REQUIRED_COLUMNS = ("timestamps", "open", "high", "low", "close", "volume", "amount")  # amount derived if absent
PRICE_COLUMNS = ("open", "high", "low", "close")
FIELDS = ("open", "high", "low", "close", "volume", "amount", "vwap", "factor", "change")
INDEX_BASE = 1000.0
_SYMBOL_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")  # a symbol becomes a folder name and an instruments-file entry
MEMBERSHIP_COLUMNS = ("symbol", "start", "end")
log = logging.getLogger(__name__)


class SubstituteBenchmarkWarning(UserWarning):
    """The benchmark written is an equal-weighted index of the universe, not the named index."""


def load_csv_folder(csv_dir: str | os.PathLike) -> dict[str, pd.DataFrame]:
    """Read every `*.csv` in `csv_dir` as {SYMBOL (file stem, upper-cased): DataFrame}, columns as written (the
    contents are checked by `build_qlib_provider`, all problems at once)."""
    folder = Path(csv_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"CSV folder {folder} does not exist (--csv-dir)")
    paths = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".csv")
    if not paths:
        raise DataError(f"no *.csv files in {folder} (--csv-dir); expected one CSV per symbol, e.g. SH600000.csv")
    frames: dict[str, pd.DataFrame] = {}
    sources: dict[str, Path] = {}
    problems = []
    for path in paths:
        symbol = path.stem.upper()
        if symbol in frames:
            problems.append(f"{path.name} and {sources[symbol].name} both give symbol {symbol}")
            continue
        try:
            frames[symbol] = pd.read_csv(path)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
            problems.append(f"{path.name}: cannot be read as CSV ({err})")
        sources[symbol] = path
    if problems:
        raise DataError(f"cannot load CSVs from {folder} (--csv-dir):\n  " + "\n  ".join(problems))
    return frames


def _rows(mask: np.ndarray, limit: int = 3) -> str:
    """'rows 4, 9, 12 (+5 more)' for the True positions of `mask` (0-based data rows: CSV line = row + 2)."""
    idx = np.flatnonzero(mask)
    more = f" (+{len(idx) - limit} more)" if len(idx) > limit else ""
    return "rows " + ", ".join(str(i) for i in idx[:limit]) + more


def _one_date(value) -> pd.Timestamp:
    """One timestamp in any format pandas knows; a time zone is dropped keeping the local wall time; NaT if not."""
    try:
        stamp = pd.Timestamp(value)
    except (ValueError, TypeError):
        return pd.NaT
    return stamp.tz_localize(None) if stamp is not pd.NaT and stamp.tzinfo is not None else stamp


def _parse_dates(raw: pd.Series) -> pd.Series:
    """Timestamps (strings or datetimes) -> naive datetime64, NaT where unparseable; tz-aware keeps its local time."""
    if pd.api.types.is_datetime64_any_dtype(raw):
        stamps = raw
    else:
        try:  # fast path: one ISO format for the whole column
            stamps = pd.to_datetime(raw, errors="coerce", format="ISO8601")
        except ValueError:  # mixed time zones
            stamps = None
        if stamps is None or (stamps.isna() & raw.notna()).any():  # e.g. 2024/01/02: value by value, slower
            stamps = pd.to_datetime(raw.map(_one_date))
    if getattr(stamps.dt, "tz", None) is not None:
        stamps = stamps.dt.tz_localize(None)
    return stamps


def _clean_daily_table(df: pd.DataFrame, symbol: str,
                       columns: dict[str, str | None] | None = None) -> tuple[pd.DataFrame | None, list[str]]:
    """One symbol's table -> (clean copy or None, problems found): see `validate_daily_frames`. Columns are found
    by model.features.resolve_columns (any case, aliases such as Date / vol, `columns` mapping first); a missing
    amount is derived from volume (model.features.fill_amount); a DatetimeIndex serves as the timestamps."""
    try:
        found = resolve_columns(list(df.columns), columns, where=symbol)
    except ColumnError as err:
        return None, [str(err).removeprefix(f"{symbol}: ")]
    if found["volume"] is None:
        return None, ["no 'volume' column (or 'vol'), which tells suspended days; map it with --columns volume=NAME"]
    if len(df) == 0:
        return None, ["has no rows"]
    if found["timestamps"] is None:
        df = df.rename_axis("timestamps").reset_index()
        found["timestamps"] = "timestamps"
    df = df.rename(columns={v: k for k, v in found.items() if v is not None})[[k for k, v in found.items() if v]]
    df = df.reset_index(drop=True)
    if found["amount"] is None:
        prices = [pd.to_numeric(df[c], errors="coerce").to_numpy(np.float64) for c in ("open", "high", "low", "close")]
        df["amount"] = fill_amount(pd.to_numeric(df["volume"], errors="coerce").to_numpy(np.float64), *prices)
    errs = []
    stamps = _parse_dates(df["timestamps"])
    if stamps.isna().any():
        errs.append(f"unparseable timestamps at {_rows(stamps.isna().to_numpy())}, "
                    f"e.g. {df['timestamps'][stamps.isna()].iloc[0]!r}")
    else:
        intraday = (stamps != stamps.dt.normalize()).to_numpy()
        if intraday.any():
            errs.append(f"intraday timestamps at {_rows(intraday)} (e.g. {stamps[intraday].iloc[0]}); "
                        "a Qlib 'day' folder needs one row per day")
        dup = stamps.duplicated(keep=False).to_numpy()
        if dup.any():
            errs.append(f"duplicate dates at {_rows(dup)} (e.g. {stamps[dup].iloc[0].date()})")
    out = pd.DataFrame({"timestamps": stamps})
    for col in REQUIRED_COLUMNS[1:]:
        out[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    checks = ([(c, out[c].isna() & df[c].notna(), "has non-numeric values") for c in REQUIRED_COLUMNS[1:]]
              + [(c, out[c] <= 0, "is <= 0") for c in PRICE_COLUMNS]
              + [(c, out[c] < 0, "is negative") for c in ("volume", "amount")])
    errs += [f"column {col!r} {what} at {_rows(bad.to_numpy())}" for col, bad, what in checks if bad.any()]
    if errs:
        return None, errs
    return out.sort_values("timestamps", kind="stable").reset_index(drop=True), []


def validate_daily_frames(frames: dict[str, pd.DataFrame],
                          columns: dict[str, str | None] | None = None) -> dict[str, pd.DataFrame]:
    """Check every table and return clean copies (`timestamps` daily datetime64, numeric columns float64, sorted),
    or raise one DataError listing every problem; row numbers are 0-based data rows (CSV line = row + 2). Empty
    cells stay NaN: a missing value is written as missing, never dropped."""
    if not frames:
        raise DataError("no symbols to build a Qlib folder from (--csv-dir is empty or --synthetic 0)")
    clean: dict[str, pd.DataFrame] = {}
    problems: list[str] = []
    for symbol, df in frames.items():
        if not _SYMBOL_RE.match(symbol):
            problems.append(f"{symbol}: symbol may only use letters, digits, '_', '.', '-' (rename the file)")
        table, errs = _clean_daily_table(df, symbol, columns)
        problems += [f"{symbol}: {e}" for e in errs]
        if table is not None:
            clean[symbol] = table
    if problems:
        raise DataError("invalid daily OHLCV input (fix the CSVs under --csv-dir):\n  " + "\n  ".join(problems))
    return clean


def suspended_days(df: pd.DataFrame) -> np.ndarray:
    """(n_rows,) bool: rows that are suspensions, i.e. volume <= 0 or missing, or close missing."""
    volume = df["volume"].to_numpy(dtype=np.float64)
    return ~(volume > 0) | np.isnan(df["close"].to_numpy(dtype=np.float64))


def qlib_fields(df: pd.DataFrame) -> pd.DataFrame:
    """One symbol's clean table -> its Qlib fields (FIELDS columns), indexed by date; suspended days all NaN."""
    t = df.set_index("timestamps")[list(REQUIRED_COLUMNS[1:])].copy()
    t.loc[suspended_days(df), :] = np.nan  # every field, so no price survives that the exchange could trade at
    volume = t["volume"].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        t["vwap"] = np.where(volume > 0, t["amount"].to_numpy() / volume, np.nan)  # no trades -> no price
    t["factor"] = np.where(t["close"].notna(), 1.0, np.nan)  # suspended days: NaN like every other field
    # Over a suspension the change is measured from the last close before it, as a price feed would report it.
    t["change"] = t["close"] / t["close"].ffill().shift(1) - 1.0
    return t[list(FIELDS)]


def equal_weight_index(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Equal-weighted index of `tables` (each from `qlib_fields`), as Qlib fields indexed by date.

    close_t = close_{t-1} * (1 + mean of the constituents' close-to-close returns on day t), starting at INDEX_BASE on
    the first day; open/high/low_t = close_t * mean of the constituents' open/high/low / close that day (so
    high >= max(open, close) and low <= min(open, close) hold for the index too); volume and amount are sums;
    vwap is the index's typical price (high + low + close) / 3."""
    def panel(field: str) -> pd.DataFrame:  # (n_days, n_symbols), NaN where a symbol has no row
        return pd.DataFrame({s: t[field] for s, t in tables.items()}).sort_index()

    close = panel("close")
    daily_ret = (close / close.ffill().shift(1) - 1.0).mean(axis=1, skipna=True).fillna(0.0)
    daily_ret.iloc[0] = 0.0
    traded = close.notna().any(axis=1)
    idx = pd.DataFrame(index=close.index[traded])
    idx["close"] = INDEX_BASE * (1.0 + daily_ret[traded]).cumprod()
    for field in ("open", "high", "low"):
        idx[field] = idx["close"] * (panel(field) / close).mean(axis=1, skipna=True)[traded]
    idx["volume"] = panel("volume").sum(axis=1, min_count=1)[traded]
    idx["amount"] = panel("amount").sum(axis=1, min_count=1)[traded]
    idx["vwap"] = (idx["high"] + idx["low"] + idx["close"]) / 3.0
    idx["factor"] = 1.0
    idx["change"] = idx["close"] / idx["close"].shift(1) - 1.0
    return idx[list(FIELDS)]


def _check_names(universe: str, benchmark: str) -> None:
    problems = []
    if not _SYMBOL_RE.match(universe):
        problems.append(f"universe={universe!r} must be a plain file name (--universe)")
    elif universe.lower() == "all":
        problems.append("universe='all' is reserved for instruments/all.txt, which also lists the benchmark; "
                        "pick another name (--universe)")
    if not _SYMBOL_RE.match(benchmark):
        problems.append(f"benchmark={benchmark!r} must be a plain symbol like SH000300 (--benchmark)")
    if problems:
        raise DataError("invalid Qlib folder settings:\n  " + "\n  ".join(problems))


def load_membership(source: str | os.PathLike | pd.DataFrame, symbols: set[str], benchmark: str) -> pd.DataFrame:
    """Point-in-time universe membership: CSV or DataFrame with columns symbol, start, end (one row per spell), as a
    clean copy (symbols upper-cased, start / end datetime64, sorted), or one DataError listing every problem (a
    member without data would be listed in the universe with no features)."""
    where = "membership file (--membership)"
    if isinstance(source, pd.DataFrame):
        raw = source.copy()
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"{where} {path} does not exist")
        raw = pd.read_csv(path, dtype=str)
        where = f"membership file {path} (--membership)"
    raw.columns = [str(c).strip().lower() for c in raw.columns]
    missing = [c for c in MEMBERSHIP_COLUMNS if c not in raw.columns]
    if missing:
        raise DataError(f"{where}: missing columns {missing}; expected a header symbol,start,end")
    if len(raw) == 0:
        raise DataError(f"{where} has no rows")
    out = pd.DataFrame({"symbol": raw["symbol"].astype(str).str.strip().str.upper(),
                        "start": _parse_dates(raw["start"]), "end": _parse_dates(raw["end"])})
    checks = [(out[c].isna(), f"unparseable {c}") for c in ("start", "end")] + [
        (out["start"] > out["end"], "start after end")]
    problems = [f"{what} at {_rows(bad.to_numpy())}" for bad, what in checks if bad.any()]
    unknown = sorted(set(out["symbol"]) - symbols - {benchmark})
    if unknown:
        problems.append(f"symbols without data: {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                        "(add their CSVs or remove their rows)")
    if benchmark in set(out["symbol"]):
        problems.append(f"the benchmark {benchmark} cannot be a member of the universe")
    out = out.sort_values(["symbol", "start"], kind="stable").reset_index(drop=True)
    if not problems:
        same = out["symbol"].eq(out["symbol"].shift())
        overlap = (same & (out["start"] <= out["end"].shift())).to_numpy()
        if overlap.any():
            problems.append("overlapping spells for " + ", ".join(sorted(set(out["symbol"][overlap]))))
    if problems:
        raise DataError(f"invalid {where}:\n  " + "\n  ".join(problems))
    return out


def _write_provider(root: Path, tables: dict[str, pd.DataFrame], universe: str, universe_symbols: list[str],
                    membership: pd.DataFrame | None) -> None:
    """Write calendar, instruments and features for `tables` ({SYMBOL: qlib_fields table}) under `root`."""
    calendar = pd.DatetimeIndex(sorted(set().union(*(t.index for t in tables.values()))))
    (root / "calendars").mkdir(parents=True)
    (root / "calendars" / "day.txt").write_text("".join(f"{d:%Y-%m-%d}\n" for d in calendar))

    spans = {s: (t.index.min(), t.index.max()) for s, t in tables.items()}
    (root / "instruments").mkdir()
    members = ([(s, *spans[s]) for s in sorted(universe_symbols)] if membership is None
               else membership[list(MEMBERSHIP_COLUMNS)].itertuples(index=False))
    for name, rows in (("all", [(s, *spans[s]) for s in sorted(tables)]), (universe.lower(), members)):
        lines = (f"{s}\t{a:%Y-%m-%d}\t{b:%Y-%m-%d}\n" for s, a, b in rows)  # symbol, first day, last day
        (root / "instruments" / f"{name}.txt").write_text("".join(lines))

    position = pd.Series(np.arange(len(calendar)), index=calendar)
    for symbol, table in tables.items():
        first, last = position[spans[symbol][0]], position[spans[symbol][1]]
        aligned = table.reindex(calendar[first:last + 1])  # (n_days_listed, n_fields), NaN on missing days
        folder = root / "features" / symbol.lower()
        folder.mkdir(parents=True)
        for field in FIELDS:  # little-endian float32 [index of the first day, values...] (docs/CONTRACTS.md)
            values = np.concatenate([[float(first)], aligned[field].to_numpy(dtype=np.float64)])
            values.astype("<f4").tofile(folder / f"{field}.day.bin")


def build_qlib_provider(frames: dict[str, pd.DataFrame], out_dir: str | os.PathLike, universe: str = "csi300",
                        benchmark: str = "SH000300", overwrite: bool = False,
                        membership: str | os.PathLike | pd.DataFrame | None = None,
                        columns: dict[str, str | None] | None = None) -> Path:
    """Write a Qlib 'day' provider folder for `frames` ({symbol: OHLCV(A) DataFrame}), as docs/CONTRACTS.md
    describes (universe, benchmark or its substitute, suspensions, membership); returns its path. build_info.json
    records the benchmark's source and the suspended-day count per symbol."""
    _check_names(universe, benchmark)
    out = Path(out_dir)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    if len({s.upper() for s in frames}) != len(frames):
        raise DataError("symbols differ only by case: " + ", ".join(sorted(frames)))
    clean = validate_daily_frames({s.upper(): df for s, df in frames.items()}, columns)
    derived = sorted(s.upper() for s, df in frames.items()
                     if resolve_columns(list(df.columns), columns, where=s)["amount"] is None)
    if derived:
        log.info("amount derived as volume * mean(open, high, low, close) for %d symbol(s) without one: %s",
                 len(derived), ", ".join(derived[:10]) + (" ..." if len(derived) > 10 else ""))

    benchmark = benchmark.upper()
    members = load_membership(membership, set(clean), benchmark) if membership is not None else None
    tables = {s: qlib_fields(df) for s, df in clean.items()}
    universe_symbols = [s for s in tables if s != benchmark]
    if not universe_symbols:
        raise DataError(f"the only table given is the benchmark {benchmark}; the universe would be empty")
    suspended = {s: int(suspended_days(df).sum()) for s, df in clean.items()}
    for symbol, n in suspended.items():
        if n:
            log.info("%s: %d day(s) with zero/missing volume or missing close written as suspended (NaN in every "
                     "field)", symbol, n)
    if benchmark in tables:
        bench_source = "given table"
    else:
        tables[benchmark] = equal_weight_index({s: tables[s] for s in universe_symbols})
        bench_source = f"substitute: equal-weighted index of {len(universe_symbols)} symbols"
        warnings.warn(f"no table for the benchmark {benchmark}: it is written as an equal-weighted index of the "
                      f"{len(universe_symbols)} universe symbols, so excess returns are NOT against the real "
                      f"{benchmark}; add {benchmark}.csv (--csv-dir) to use the real index",
                      SubstituteBenchmarkWarning, stacklevel=2)
    info = {"universe": universe.lower(), "benchmark": benchmark, "benchmark_source": bench_source,
            "point_in_time_membership": members is not None, "symbols": len(universe_symbols),
            "amount_derived": derived,
            "suspended_days": {s: n for s, n in sorted(suspended.items()) if n}}

    with atomic_dir(out) as staging:  # a reader sees the old store or the complete new one, never half of one
        _write_provider(staging, tables, universe, universe_symbols, members)
        write_json(staging / "build_info.json", info)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kronos build-qlib-store", description=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--csv-dir", help="folder of daily <SYMBOL>.csv files")
    source.add_argument("--synthetic", type=int, metavar="N", help="generate N synthetic daily series instead")
    p.add_argument("--out", required=True, help="provider folder to create")
    p.add_argument("--universe", default="csi300", help="market name: instruments/<universe>.txt")
    p.add_argument("--benchmark", default="SH000300",
                   help="benchmark symbol; a CSV of that name is used as is, else an equal-weighted index is built")
    p.add_argument("--membership", help="CSV symbol,start,end: point-in-time universe membership")
    p.add_argument("--columns", default="", metavar="FIELD=NAME,...",
                   help="map candle fields to your column names, e.g. timestamps=Trade Date,volume=Vol")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    synth = p.add_argument_group("synthetic data (with --synthetic)")
    synth.add_argument("--start", default="2018-01-02", help="first day")
    synth.add_argument("--end", default="2025-06-30", help="last day")
    synth.add_argument("--seed", type=int, default=0, help="same seed, same data")
    args = p.parse_args(argv)
    if args.synthetic is not None and args.synthetic < 1:
        p.error("--synthetic N needs N >= 1")
    pairs = [item.split("=", 1) for item in args.columns.split(",") if item.strip()]
    if any(len(pair) != 2 for pair in pairs):
        p.error(f"--columns {args.columns!r}: expected FIELD=NAME pairs separated by commas")
    args.columns = {k.strip(): v.strip() for k, v in pairs}
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if args.csv_dir is not None:
                frames = load_csv_folder(args.csv_dir)
            else:
                frames = generate_ohlcv(args.synthetic, freq="1D", start=args.start, end=args.end, seed=args.seed)
            out = build_qlib_provider(frames, args.out, universe=args.universe, benchmark=args.benchmark,
                                      overwrite=args.overwrite, membership=args.membership,
                                      columns=args.columns or None)
            print(f"built Qlib provider {out}: {len(frames)} symbols, universe {args.universe}, benchmark "
                  f"{args.benchmark}")
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
    except (ValueError, FileNotFoundError, FileExistsError) as err:  # bad input: the message, not a traceback
        raise SystemExit(f"error: {err}") from None

