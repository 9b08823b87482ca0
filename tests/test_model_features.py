"""The candle contract in model/features.py: names, normalisation (== the engine's window math), filling."""
import numpy as np
import pandas as pd
import pytest

from model.config import Window
from model.features import (
    CLOSE,
    FEATURES,
    PRICE_FEATURES,
    TIME_FEATURES,
    candle_matrix,
    denormalize,
    fill_amount,
    normalize,
)


def test_contract_names():
    assert FEATURES == ("open", "high", "low", "close", "volume", "amount")
    assert PRICE_FEATURES == ("open", "high", "low", "close")
    assert TIME_FEATURES == ("minute", "hour", "weekday", "day", "month")
    assert CLOSE == 3


def test_normalize_is_bit_identical_to_window_dataset_get_batch():
    from finetune.utils.windows import SeriesArrays, WindowDataset
    rng = np.random.default_rng(0)
    n, lookback, predict = 60, 12, 4
    feats = (100 * np.exp(np.cumsum(rng.normal(0, 0.02, (n, 6)), axis=0))).astype(np.float32)
    feats[:, 4:] *= 1e4  # volume/amount on another scale
    stamps = np.zeros((n, 5), dtype=np.int64)
    ds = WindowDataset([SeriesArrays(feats, stamps, "A")], Window(lookback, predict, 5))
    idx = np.arange(len(ds))
    x_ref, _ = ds.get_batch(idx)                                           # (B, W, F)
    block = np.stack([feats[i:i + lookback + predict].T for i in idx])     # (B, F, W)
    x, mean, std = normalize(block.copy(), 5, axis=-1, stats_len=lookback)
    assert mean.shape == std.shape == (len(idx), 6, 1)
    np.testing.assert_array_equal(x.transpose(0, 2, 1), x_ref.numpy())


def test_normalize_statistics_use_only_the_first_stats_len_steps():
    x = np.array([[1.0], [3.0], [100.0]])  # (T=3, F=1)
    out, mean, std = normalize(x, clip=1e9, axis=0, stats_len=2)
    assert mean.ravel().tolist() == [2.0] and std.ravel().tolist() == [1.0]  # population std of [1, 3]
    np.testing.assert_allclose(out.ravel(), [(1 - 2) / (1 + 1e-5), (3 - 2) / (1 + 1e-5), 98 / (1 + 1e-5)])
    clipped, _, _ = normalize(x, clip=5, axis=0, stats_len=2)
    assert clipped.ravel()[2] == 5.0
    with pytest.raises(ValueError, match="stats_len"):
        normalize(x, 5, axis=0, stats_len=4)
    with pytest.raises(ValueError, match="stats_len"):
        normalize(x, 5, axis=0, stats_len=0)


def test_normalize_constant_series_and_denormalize_round_trip():
    rng = np.random.default_rng(1)
    x = rng.normal(50, 3, (40, 6))
    x[:, 5] = 7.0  # constant column: std 0 -> normalised 0, not NaN
    xn, mean, std = normalize(x, clip=100, axis=0)
    assert np.isfinite(xn).all() and (xn[:, 5] == 0).all()
    np.testing.assert_allclose(xn[:, :5].mean(axis=0), 0, atol=1e-12)
    np.testing.assert_allclose(denormalize(xn, mean, std), x, rtol=1e-12)


def test_fill_amount_and_candle_matrix():
    o, h, low, c, v = (np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([1.0, 1.0]), np.array([3.0, 1.0]),
                       np.array([10.0, 0.5]))
    np.testing.assert_array_equal(fill_amount(v, o, h, low, c), [20.0, 1.0])
    df = pd.DataFrame({"open": o, "high": h, "low": low, "close": c, "volume": v})
    np.testing.assert_array_equal(candle_matrix(df)[:, 5], [20.0, 1.0])
    no_volume = candle_matrix(df.drop(columns="volume"))
    assert no_volume.dtype == np.float32 and (no_volume[:, 4:] == 0).all()
    np.testing.assert_array_equal(no_volume[:, :4], df[list(PRICE_FEATURES)].to_numpy(np.float32))


def test_candle_faults_name_each_broken_rule_and_its_rows():
    from model.features import candle_faults

    good = np.array([[10.0, 11, 9, 10.5, 1, 1], [10.5, 12, 10, 11, 1, 1]])
    assert candle_faults(good) == []
    bad = np.array([[10.0, 9.5, 9, 10.5, 1, 1],     # high below the close
                    [-1.0, 12, -2, 11, 1, 1],        # open and low <= 0
                    [10.0, 11, 10.2, 10.5, 1, 1],    # low above the open
                    [np.nan, 11, 9, 10, 1, 1]])      # NaN breaks no rule (each door has its NaN policy)
    got = {(f, rule): rows.tolist() for f, rows, rule in candle_faults(bad)}
    assert got == {("open", "<= 0 (prices must be positive)"): [False, True, False, False],
                   ("low", "<= 0 (prices must be positive)"): [False, True, False, False],
                   ("high", "below max(open, close)"): [True, False, False, False],
                   ("low", "above min(open, close)"): [False, False, True, False]}


def test_time_features_equal_pandas_field_accessors_on_any_clock_era_and_unit():
    """The integer arithmetic of `time_features` (what every forecast computes per series) reads the same minute,
    hour, weekday, day and month as pandas' accessors: before 1970, after 2038, tz-aware (each zone's own wall
    clock) and in second resolution."""
    from model.features import time_features

    rng = np.random.default_rng(0)
    utc = pd.DatetimeIndex(rng.integers(-2 * 10**18, 4 * 10**18, 5000)).tz_localize("UTC")
    for idx in (utc.tz_localize(None), utc.tz_convert("Asia/Shanghai"), utc.tz_convert("America/New_York"),
                pd.date_range("1900-01-01", periods=500, freq="37h").as_unit("s")):
        expected = np.stack([idx.minute, idx.hour, idx.day_of_week, idx.day, idx.month], axis=1)
        np.testing.assert_array_equal(time_features(idx), expected)
