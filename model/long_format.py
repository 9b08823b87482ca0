"""Long-format forecasting (in the style of Chronos' `predict_df`): one frame with many series, one row per candle.

Input columns: `id_column`, `timestamp_column`, open/high/low/close (volume/amount optional). Output: one row per
series and forecast step with columns id, timestamps, FEATURES (the mean forecast) and, when quantiles are asked,
`{feature}_{q}` columns (e.g. close_0.1).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

from .features import FEATURES, PRICE_FEATURES

if TYPE_CHECKING:
    from .predictor import KronosPredictor


def future_timestamps(timestamps: pd.DatetimeIndex, prediction_length: int, freq: str | None,
                      series: object) -> pd.DatetimeIndex:
    """The `prediction_length` timestamps after `timestamps`, at `freq` or the series' inferred frequency."""
    if freq is None:
        if len(timestamps) < 3:
            raise ValueError(f"series {series!r} has {len(timestamps)} rows: too few to infer its frequency; pass "
                             "freq= (e.g. freq='5min')")
        with warnings.catch_warnings():  # pandas 3 warns that infer_freq will return an offset; both work below
            warnings.simplefilter("ignore")
            freq = pd.infer_freq(timestamps)
        if freq is None:
            raise ValueError(f"series {series!r}: cannot infer a regular frequency from its timestamps (gaps such as "
                             "market closes?); pass freq= (e.g. freq='5min' or freq='B')")
    try:
        offset = pd.tseries.frequencies.to_offset(freq)
    except ValueError:
        raise ValueError(f"freq {freq!r} is not a pandas frequency string (e.g. '5min', 'h', 'D', 'B')") from None
    return pd.date_range(timestamps[-1] + offset, periods=prediction_length, freq=offset)


def predict_df(predictor: KronosPredictor, df: pd.DataFrame, *, prediction_length: int, id_column: str = "id",
               timestamp_column: str = "timestamps", freq: str | None = None, quantiles: Sequence[float] = (),
               T: float = 1.0, top_k: int | None = 0, top_p: float | None = 0.9, sample_count: int = 1,
               verbose: bool = False) -> pd.DataFrame:
    """Forecast every series of a long frame.

    Parameters
    ----------
    predictor: the KronosPredictor.
    df: long frame, one row per candle: `id_column`, `timestamp_column` (datetimes), open/high/low/close
        (+ volume/amount). Rows are sorted by timestamp within each series; series may differ in length.
    prediction_length: steps to forecast per series.
    freq: pandas frequency of the forecast timestamps; None = infer each series' own (`pd.infer_freq`).
    quantiles: quantile levels in [0, 1] to add as `{feature}_{q}` columns (from `sample_count` paths).
    T, top_k, top_p, sample_count, verbose: as in `KronosPredictor.predict`.

    Returns
    -------
    DataFrame with prediction_length rows per series (series in order of first appearance): id_column,
    timestamp_column, FEATURES (mean forecast), then the quantile columns.
    """
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"df must be a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in (id_column, timestamp_column, *PRICE_FEATURES) if c not in df.columns]
    if missing:
        raise ValueError(f"df is missing columns {missing} (id_column={id_column!r}, "
                         f"timestamp_column={timestamp_column!r}, prices {list(PRICE_FEATURES)})")
    if len(df) == 0:
        raise ValueError("df is empty: no series to forecast")
    if df[id_column].isna().any():
        raise ValueError(f"column {id_column!r} has missing ids; every row must belong to a series")
    quantiles = list(quantiles)
    ids, frames, x_ts, y_ts = [], [], [], []
    for sid, part in df.groupby(id_column, sort=False):
        part = part.sort_values(timestamp_column, kind="stable")
        ts = part[timestamp_column]
        if not pd.api.types.is_datetime64_any_dtype(ts):
            raise ValueError(f"column {timestamp_column!r} must hold datetimes (dtype {ts.dtype}); convert it with "
                             "pd.to_datetime first")
        index = pd.DatetimeIndex(ts)
        ids.append(sid)
        frames.append(part[[c for c in FEATURES if c in part.columns]].reset_index(drop=True))
        x_ts.append(index)
        y_ts.append(future_timestamps(index, prediction_length, freq, sid))
    results = predictor.predict_batch(frames, x_ts, y_ts, prediction_length, T, top_k, top_p, sample_count, verbose,
                                      False, quantiles or None)
    out = []
    for sid, y, res in zip(ids, y_ts, results):
        mean = res.mean if quantiles else res
        part = pd.DataFrame({id_column: [sid] * prediction_length, timestamp_column: y})
        part[list(FEATURES)] = mean.to_numpy()
        for q in quantiles:
            part[[f"{f}_{q}" for f in FEATURES]] = res.quantiles[q].to_numpy()
        out.append(part)
    return pd.concat(out, ignore_index=True)
