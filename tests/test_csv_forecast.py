"""Held-out windows and their sampled forecasts (finetune_csv.forecast), candle consistency (forecast_metrics)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from finetune.evaluation.held_out import held_out_windows, sample_paths, spread_evenly
from finetune_csv.forecast import candle_violations
from model.config import Window
from tests.csv_reference import one_series_split


def test_candle_violations_counts_each_rule_and_any():
    #              ok    high<close  low>open  vol<0 and high<open
    open_ = np.array([10.0, 10.0, 10.0, 12.0])
    close = np.array([11.0, 11.0, 9.0, 11.0])
    high = np.array([11.5, 10.5, 10.5, 11.5])
    low = np.array([9.5, 9.5, 9.5, 10.0])
    volume = np.array([1.0, 1.0, 1.0, -1.0])
    v = candle_violations(open_, high, low, close, volume)
    assert v["high_below_body"] == pytest.approx(2 / 4)
    assert v["low_above_body"] == pytest.approx(1 / 4)
    assert v["negative_volume"] == pytest.approx(1 / 4)
    assert v["any"] == pytest.approx(3 / 4)


def test_spread_evenly_includes_both_ends():
    assert spread_evenly(10, 3).tolist() == [0, 4, 9]  # round(4.5) -> 4 (banker's rounding)
    assert spread_evenly(2, 5).tolist() == [0, 1]
    assert spread_evenly(0, 3).tolist() == []


def make_segment(n: int = 60, first_target: int = 30):
    values = np.arange(n * 6, dtype=np.float64).reshape(n, 6)  # row r holds 6r .. 6r+5 (exact in float32)
    ts = pd.date_range("2024-01-02 09:30", periods=n, freq="5min")
    return one_series_split(values, ts, start=first_target - 8, first_target=first_target, stop=n)


def test_held_out_windows_do_not_overlap_and_follow_their_context():
    seg = make_segment()
    w = held_out_windows(seg, Window(8, 4), stride=None)
    assert len(w.names) == 30 // 4  # 30 test rows -> 7 non-overlapping horizons of 4
    first_rows = [int(a[0, 0]) // 6 for a in w.actual]
    assert first_rows == list(range(30, 58, 4))
    for ctx, x_ts, y_ts, actual in zip(w.context, w.x_timestamps, w.y_timestamps, w.actual):
        assert ctx.shape == (8, 6) and ctx[-1, 0] + 6 == actual[0, 0]  # context ends right before the horizon
        assert x_ts[-1] < y_ts[0] and len(y_ts) == 4


def test_held_out_windows_can_be_capped_per_series():
    w = held_out_windows(make_segment(), Window(8, 4), max_windows=2)
    assert [int(a[0, 0]) // 6 for a in w.actual] == [30, 54]


def test_the_sample_mean_equals_predict_batch_on_dataframes():
    from types import SimpleNamespace

    import torch

    from model import KronosPredictor
    from model.features import FEATURES
    from tests.model_factory import tiny_models

    tok, pred = tiny_models(seed=2)
    rng = np.random.default_rng(0)
    values = 100 + np.abs(rng.normal(0, 1, (80, 6))).cumsum(axis=0)
    values[:, 1], values[:, 2] = values[:, :4].max(axis=1), values[:, :4].min(axis=1)  # valid candles
    ts = pd.date_range("2024-01-02 09:30", periods=80, freq="5min")
    seg = one_series_split(values, ts, start=40, first_target=48, stop=80)
    w = held_out_windows(seg, Window(8, 4), max_windows=5)
    kp = KronosPredictor(pred, tok, device="cpu", max_context=12, clip=5)
    f = SimpleNamespace(seed=3, temperature=1.0, top_k=0, top_p=0.9, sample_count=2)
    x_stamps, y_stamps = w.stamps()
    paths = sample_paths(kp, w.context, x_stamps, y_stamps, 4, f, batch=3)  # (N, 2, 4, 6)
    assert paths.shape == (len(w), 2, 4, 6) and paths.dtype == np.float64
    got = paths.mean(axis=1)
    torch.manual_seed(3)
    frames = [pd.DataFrame(c, columns=FEATURES) for c in w.context]
    expected = []
    for i in range(0, len(frames), 3):
        out = kp.predict_batch(frames[i:i + 3], w.x_timestamps[i:i + 3], w.y_timestamps[i:i + 3], 4, T=1.0,
                               top_k=0, top_p=0.9, sample_count=2, verbose=False)
        expected += [df[list(FEATURES)].to_numpy(np.float64) for df in out]
    # predict_batch averages the paths before scaling them back; the same numbers up to float32 rounding.
    np.testing.assert_allclose(got, np.stack(expected), rtol=1e-5)


@pytest.mark.parametrize("split, stride, cap", [("test", None, None), ("val", 3, None), ("test", 2, 3)])
def test_windows_from_the_store_equal_the_pandas_reference_windows(tmp_path, split, stride, cap):
    from finetune.synthetic import generate_ohlcv, write_csv_folder
    from finetune_csv.config import DataConfig
    from finetune_csv.prepare import prepare_data
    from tests.csv_reference import load_series, reference_held_out_windows, split_series

    frames = generate_ohlcv(n_series=3, n_bars=200, freq="5min", seed=4)
    frames = {k: f.iloc[:n] for (k, f), n in zip(frames.items(), (200, 163, 181))}  # unequal lengths
    write_csv_folder(frames, tmp_path / "data")
    cfg = DataConfig(path=str(tmp_path / "data"), lookback=12, predict=5, train_ratio=0.6, val_ratio=0.2,
                     test_ratio=0.2, split="per_series")  # the reference cuts each series by its own rows
    ours = held_out_windows(prepare_data(cfg, tmp_path / "store").splits[split], Window(12, 5), stride, cap)
    ref = reference_held_out_windows(split_series(load_series(cfg), cfg)[split], 12, 5, stride, cap)
    assert len(ours) == len(ref["names"]) > 3 and ours.names == ref["names"]  # same windows, same order
    # The store holds float32 (what training reads): the same numbers as the reference rounded to float32.
    f32 = lambda a: a.astype(np.float32).astype(np.float64)
    assert ours.context.dtype == np.float64 and np.array_equal(ours.context, f32(ref["context"]))
    assert np.array_equal(ours.actual, f32(ref["actual"]))
    assert all(a.equals(b) for a, b in zip(ours.x_timestamps, ref["x_ts"]))
    assert all(a.equals(b) for a, b in zip(ours.y_timestamps, ref["y_ts"]))
