"""The candle contract (its one home) and the numpy feature functions every data path and the forecaster share:
FEATURES, TIME_FEATURES, the clipped per-window z-score and its relative epsilon (`std_eps`). The contract and why
the epsilon is relative: docs/CONTRACTS.md, "File formats: the candle and its normalisation"."""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from model.errors import DataError

FEATURES: tuple[str, ...] = ("open", "high", "low", "close", "volume", "amount")
PRICE_FEATURES: tuple[str, ...] = FEATURES[:4]
TIME_FEATURES: tuple[str, ...] = ("minute", "hour", "weekday", "day", "month")
CLOSE: int = FEATURES.index("close")
STD_EPS = 1e-5  # added to the std before dividing (a constant series normalises to 0, not NaN), see std_eps
CANDLE_COLUMNS: tuple[str, ...] = ("timestamps", *FEATURES)
REQUIRED_COLUMNS: tuple[str, ...] = ("timestamps", *PRICE_FEATURES)
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {"timestamps": ("timestamp", "date", "datetime", "time", "dt",
                                                             "trade_date"),
                                              "volume": ("vol",), "amount": ("amt", "turnover")}


class ColumnError(DataError):
    """A candle column is missing, ambiguous or mis-mapped in a user's frame or file."""


def resolve_columns(names: Sequence[str], explicit: Mapping[str, str | None] | None = None, *,
                    where: str) -> dict[str, str | None]:
    """{canonical: the user's column or None} for every CANDLE_COLUMNS field, out of the column `names`: `explicit`
    mappings win (None = "not a column": volume/amount absent, timestamps from a DatetimeIndex); any
    other field matches its own name in any case, else one of COLUMN_ALIASES. ColumnError naming `where` (with a
    close match) for a missing required column, two columns matching one field, or an explicit non-column."""
    names = [str(n) for n in names]
    explicit = dict(explicit or {})
    shown = names[:12] + ([f"... {len(names) - 12} more"] if len(names) > 12 else [])  # bounded message length
    unknown = sorted(set(explicit) - set(CANDLE_COLUMNS))
    if unknown:
        raise ColumnError(f"{where}: {unknown} are not candle fields; map only {list(CANDLE_COLUMNS)}")
    out: dict[str, str | None] = {}
    for field, name in explicit.items():
        if name is not None and names.count(str(name)) != 1:
            problem = "is not a column" if str(name) not in names else "names more than one column"
            raise ColumnError(f"{where}: {name!r} (mapped to {field}) {problem}{_did_you_mean(str(name), names)}; "
                              f"columns: {shown}")
        out[field] = None if name is None else str(name)
    taken = {n for n in out.values() if n is not None}
    for field in CANDLE_COLUMNS:
        if field in out:
            continue
        free = [n for n in names if n not in taken]
        matches = [n for n in free if n.strip().lower() == field]
        matches = matches or [n for n in free if n.strip().lower() in COLUMN_ALIASES.get(field, ())]
        if len(matches) > 1:
            raise ColumnError(f"{where}: columns {matches} all match {field!r}; keep one, or map {field} to one of "
                              "them explicitly")
        out[field] = matches[0] if matches else None
    missing = [f for f in REQUIRED_COLUMNS if out[f] is None and f not in explicit]
    if missing:
        f = missing[0]
        also = f" (or one of {list(COLUMN_ALIASES[f])})" if f in COLUMN_ALIASES else ""
        unused = [n for n in names if n not in set(out.values())]
        last = next((n for n in unused if n.strip().lower() in ("last", "last price")), None) if f == "close" else None
        hint = f"; {last!r} may be the close: map close to it" if last else _did_you_mean(f, unused)
        raise ColumnError(f"{where}: no {f!r} column{also}, in any case{hint}; columns: {shown}")
    bad = [f for f in PRICE_FEATURES if out[f] is None]
    if bad:
        raise ColumnError(f"{where}: the price columns {bad} cannot be mapped to None: they are required")
    return out


ADJUST = ("none", "adj_close")  # data.adjust / predict_df(adjust=): how prices are adjusted for splits and dividends
ADJ_CLOSE_NAMES = ("adj close", "adj_close", "adjclose", "adjusted close", "adj. close")


def adjust_prices(values: np.ndarray, adj_close: np.ndarray) -> np.ndarray:
    """`values (n, >= 4)` open, high, low, close all scaled by adj_close / close (a Yahoo-style export adjusts only
    its 'Adj Close'; one factor per row keeps every candle's shape). The close is scaled too rather than replaced by
    adj_close: a low equal to the close must stay equal, not land an ulp above it and be refused as a bad candle."""
    out = np.array(values, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.asarray(adj_close, dtype=np.float64) / out[:, 3]  # (n,)
    out[:, :4] *= ratio[:, None]
    return out


def adj_close_column(names: Sequence[str]) -> str | None:
    """The column holding adjusted closes ('Adj Close', any case and spelling of ADJ_CLOSE_NAMES), or None."""
    return next((str(n) for n in names if str(n).strip().lower() in ADJ_CLOSE_NAMES), None)


def timestamp_parts(names: Sequence[str], wanted: str | None = "timestamps") -> list[str] | None:
    """The [date, time] columns whose text joined by a space is the timestamp (the common intraday export), or None:
    `wanted` 'Date+Time' names them; with `wanted` left at 'timestamps', a header with a 'date' and a 'time' column
    (any case) and no other timestamp column is read so. ColumnError when a named part is not a column."""
    names = [str(n) for n in names]
    if wanted and "+" in wanted and wanted not in names:
        parts = [p.strip() for p in wanted.split("+")]
        missing = [p for p in parts if p not in names]
        if missing:
            raise ColumnError(f"the timestamp {wanted!r} joins the columns {parts}, but {missing} are not columns"
                              f"{_did_you_mean(missing[0], names)}")
        return parts
    lowered = {n.strip().lower(): n for n in names}
    if wanted != "timestamps" or {"timestamps", "timestamp", "datetime", "dt", "trade_date"} & set(lowered):
        return None
    return [lowered["date"], lowered["time"]] if "date" in lowered and "time" in lowered else None


def _did_you_mean(name: str, names: Sequence[str]) -> str:
    lowered = {n.strip().lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


def quantile_column(feature: str, q: float) -> str:
    """The column of quantile `q` of `feature`: `close_q10`, `close_q2.5` (percent, an integer when whole)."""
    pct = round(float(q) * 100, 6)
    return f"{feature}_q{int(pct) if pct.is_integer() else pct}"


def normalize(x: np.ndarray, clip: float, *, axis: int = 0,
              stats_len: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-feature z-score along the time `axis` of x, e.g. (T, F) with axis=0 or (B, F, W) with axis=-1, clipped to
    [-clip, clip] -> (x_norm, mean, std), mean/std with keepdims, std the population std. stats_len: only the first
    `stats_len` steps give mean/std (the lookback part of a training window: the future must not leak into its own
    normalisation). Bit-identical to `WindowDataset.get_batch` on its (B, F, W) block."""
    x = np.asarray(x)
    axis = axis % x.ndim
    n = x.shape[axis] if stats_len is None else int(stats_len)
    if not 1 <= n <= x.shape[axis]:
        raise ValueError(f"stats_len must be in [1, {x.shape[axis]}] (the length along axis {axis}), got {stats_len}")
    past = x if stats_len is None else np.take(x, np.arange(n), axis=axis)
    mean = past.mean(axis=axis, keepdims=True)
    centred = past - mean
    # Sum of squares through einsum over the moved-last axis: the same arithmetic order as window_dataset.
    moved = np.moveaxis(centred, axis, -1)
    sq = np.einsum("...w,...w->...", moved, moved)
    std = np.expand_dims(np.sqrt(sq / n), axis)
    out = x - mean
    out /= std + std_eps(mean)
    np.clip(out, -clip, clip, out=out)
    return out, mean, std


def std_eps(mean: np.ndarray) -> np.ndarray:
    """The epsilon added to each feature's std, same shape and dtype as `mean`: STD_EPS where |mean| >= 1 (or 0: an
    all-zero volume), STD_EPS * |mean| below, so that multiplying a series by any power of ten scales its eps with
    it (a relative 1e-5, far below any market's spread) while prices >= 1 keep the original's exact numbers."""
    m = np.abs(mean)
    return STD_EPS * np.where((m > 0) & (m < 1), m, 1).astype(m.dtype, copy=False)


def denormalize(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Inverse of `normalize` (before clipping): `x * (std + std_eps(mean)) + mean`, mean/std as returned."""
    return x * (std + std_eps(mean)) + mean


def fill_amount(volume: np.ndarray, open_: np.ndarray, high: np.ndarray, low: np.ndarray,
                close: np.ndarray) -> np.ndarray:
    """Traded amount estimated from volume: `volume * mean(open, high, low, close)`, element-wise (any shape)."""
    return volume * ((open_ + high + low + close) / 4)


def to_datetime_index(timestamps, name: str = "timestamps") -> pd.DatetimeIndex:
    """Series / Index / list of datetimes -> DatetimeIndex; strings or numbers are rejected (ambiguous)."""
    values = timestamps if isinstance(timestamps, pd.DatetimeIndex) else pd.Index(timestamps)
    if not isinstance(values, pd.DatetimeIndex):
        raise DataError(f"{name} must be datetimes (datetime64 Series/Index or pd.Timestamp values), got dtype "
                         f"{values.dtype}; convert with pd.to_datetime first")
    if values.hasnans:
        raise DataError(f"{name} contains missing values (NaT)")
    try:  # pandas 3 holds later years (datetime64[us]); the nanosecond time features would wrap
        if values.unit != "ns":  # nanoseconds are in range by construction (the usual case: no copy per series)
            values.as_unit("ns")
    except pd.errors.OutOfBoundsDatetime:
        naive = values.tz_localize(None) if values.tz is not None else values
        outside = np.flatnonzero((naive < pd.Timestamp.min) | (naive > pd.Timestamp.max))
        raise DataError(f"{name}: {len(outside)} timestamp(s) outside 1677-2262 (what datetime64[ns] holds), first "
                        f"{values[outside[0]]} at position {outside[0]}") from None
    return values


def check_increasing(timestamps: pd.DatetimeIndex, name: str = "timestamps") -> None:
    """Strictly increasing, or DataError naming the first offending position."""
    bad = np.flatnonzero(np.diff(timestamps.asi8) <= 0)  # empty for 0 or 1 stamps
    if bad.size:
        i = int(bad[0]) + 1
        raise DataError(f"{name} must be strictly increasing; position {i} ({timestamps[i]}) does not come after "
                        f"position {i - 1} ({timestamps[i - 1]})")


def time_features(timestamps) -> np.ndarray:
    """T datetimes -> (T, 5) int64 in TIME_FEATURES order (minute, hour, weekday Monday=0, day, month), read on the
    stamps' own wall clock. Integer arithmetic on the nanoseconds: pandas' five field accessors cost ~60x more,
    which a forecast of hundreds of series pays on the host for every series."""
    ts = to_datetime_index(timestamps)
    wall = ts.tz_localize(None) if ts.tz is not None else ts
    ns = wall.asi8 if wall.unit == "ns" else wall.as_unit("ns").asi8  # wall-clock ns since 1970
    minutes = ns // 60_000_000_000
    days = minutes // 1440
    date = days.astype("datetime64[D]")
    month_start = date.astype("datetime64[M]")
    return np.stack([minutes % 60, minutes // 60 % 24, (days + 3) % 7,  # 1970-01-01 was a Thursday (3)
                     (date - month_start).astype(np.int64) + 1, month_start.astype(np.int64) % 12 + 1], axis=1)


def calc_time_stamps(timestamps) -> pd.DataFrame:
    """T datetimes -> a (T, 5) DataFrame of ints, columns TIME_FEATURES (weekday: Monday=0)."""
    return pd.DataFrame(time_features(timestamps), columns=list(TIME_FEATURES))


BODY_RULES = {"high": "below max(open, close)", "low": "above min(open, close)"}  # the wick rules of candle_faults


def candle_faults(values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
    """The candle rules (their one home), on values (n, >= 4) in FEATURES order: [(field, rows (n,) bool, rule)] for
    every rule some row breaks: a price <= 0 (per price field), a high below max(open, close), a low above
    min(open, close). NaN breaks no rule (each door has its own NaN policy)."""
    o, h, lo, c = (values[:, i] for i in range(4))
    rules = [(f, values[:, i] <= 0, "<= 0 (prices must be positive)") for i, f in enumerate(PRICE_FEATURES)]
    rules += [("high", h < np.maximum(o, c), BODY_RULES["high"]), ("low", lo > np.minimum(o, c), BODY_RULES["low"])]
    return [(f, bad, rule) for f, bad, rule in rules if bad.any()]


F32 = np.finfo(np.float32)
FLOAT32_RULE = (f"float32 cannot hold (the model's numbers: beyond +-{F32.max:.4g} they become inf, nonzero below "
                f"{F32.tiny:.4g} in magnitude 0 or lose their digits)")


def float32_lost(x: np.ndarray) -> np.ndarray:
    """(same shape) bool: the finite values of `x` that the cast to float32 does not keep: beyond its range, or
    nonzero below its smallest normal number (a price of 1e-46 would be trained on as 0). The one float32 rule of
    every door, checked on the float64 values before the cast; NaN/inf are each door's own policy."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    with np.errstate(invalid="ignore"):
        return np.isfinite(a) & ((a > F32.max) | ((a > 0) & (a < F32.tiny)))


def candle_matrix(df: pd.DataFrame, name: str = "df") -> np.ndarray:
    """DataFrame with open/high/low/close (+ optional volume/amount; any case, the `resolve_columns` aliases) -> float32
    (T, 6) in FEATURES order. Missing `volume` -> volume and amount are 0; missing `amount` -> `fill_amount` (volume
    * mean(OHLC)). Raises DataError naming `name`, the column and the first row (with its index label when the index
    is not a RangeIndex, e.g. the timestamps) for a missing column, non-numeric data, NaN/inf, a value float32 does
    not keep (`float32_lost`) or a broken `candle_faults` rule."""
    if not isinstance(df, pd.DataFrame):
        raise DataError(f"{name} must be a pandas DataFrame, got {type(df).__name__}")
    if len(df) == 0:
        raise DataError(f"{name} is empty: at least one candle of context is needed")
    names = [str(c) for c in df.columns]
    mapping = resolve_columns(names, {"timestamps": None}, where=name)
    present = [c for c in FEATURES if mapping[c] is not None]
    where = [names.index(mapping[c]) for c in present]  # column positions (names are unique: resolve_columns)
    # One block copy when every column is an int or a float (the usual frame: ~25x faster than selecting by name
    # and reading dtypes, which a forecast of hundreds of series pays per series); else column by column.
    x = df.to_numpy()
    if x.dtype.kind not in "iuf":
        non_numeric = [names[j] for j in where if not pd.api.types.is_numeric_dtype(df.dtypes.iloc[j])
                       or pd.api.types.is_bool_dtype(df.dtypes.iloc[j])]
        if non_numeric:
            raise DataError(f"{name} has non-numeric columns {non_numeric}; convert them to numbers")
        x = df.iloc[:, where]
    x = np.asarray(x[:, where] if isinstance(x, np.ndarray) else x, dtype=np.float64)
    at = lambda r: f"row {r}" + ("" if isinstance(df.index, pd.RangeIndex) else f" ({df.index[r]})")
    for bad, what in ((~np.isfinite(x), "NaN/inf"), (float32_lost(x), FLOAT32_RULE)):
        if bad.any():
            rows, cols = np.nonzero(bad)
            raise DataError(f"{name} has {int(bad.sum())} value(s) {what}, first in column "
                            f"{mapping[present[cols[0]]]!r} at {at(int(rows[0]))} ({x[rows[0], cols[0]]:.6g}); "
                            "fill, drop or rescale them before forecasting")
    for f, rows, rule in candle_faults(x):
        r = int(np.flatnonzero(rows)[0])
        raise DataError(f"{name}: column {mapping[f]!r} is {rule} in {int(rows.sum())} candle(s), first at {at(r)}; "
                        "fix or drop these rows")
    cols = {c: x[:, j] for j, c in enumerate(present)}
    if "volume" not in cols:
        cols["volume"] = np.zeros(len(x))
        cols["amount"] = np.zeros(len(x))
    elif "amount" not in cols:
        cols["amount"] = fill_amount(cols["volume"], *(cols[c] for c in PRICE_FEATURES))
    return np.stack([cols[c] for c in FEATURES], axis=1).astype(np.float32)
