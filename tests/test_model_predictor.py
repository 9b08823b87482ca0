"""Forecasting: cached generation equals full recompute, sampling options, returned shapes, bad input."""
import numpy as np
import pandas as pd
import pytest
import torch

from model import Forecast, KronosPredictor, generate_tokens, sample_from_logits
from model.errors import DataError
from tests.model_factory import tiny_models


def candles(n, seed=0, start="2024-01-02 09:30", freq="5min"):
    rng = np.random.default_rng(seed)
    close = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, n)))
    open_ = np.r_[close[0], close[:-1]]
    high = np.maximum(open_, close) * (1 + rng.uniform(0, 0.005, n))
    low = np.minimum(open_, close) * (1 - rng.uniform(0, 0.005, n))
    vol = rng.uniform(1e3, 5e3, n)
    ts = pd.date_range(start, periods=n, freq=freq)
    df = pd.DataFrame({"open": open_, "high": high, "low": low, "close": close, "volume": vol,
                       "amount": vol * close})
    return df, pd.Series(ts), pd.Series(pd.date_range(ts[-1] + pd.Timedelta(freq), periods=64, freq=freq))


def predictors(max_context):
    tok, pred = tiny_models(seed=1)
    return (KronosPredictor(pred, tok, device="cpu", max_context=max_context, use_cache=True),
            KronosPredictor(pred, tok, device="cpu", max_context=max_context, use_cache=False))


@pytest.mark.parametrize("n_ctx, pred_len, max_context", [
    (20, 10, 64),   # everything fits in the window
    (20, 30, 32),   # the window starts sliding during the forecast
    (32, 5, 32),    # the context fills the window exactly
    (40, 8, 32),    # the context alone is longer than the window
])
def test_cache_equals_recompute_greedy(n_ctx, pred_len, max_context):
    cached, plain = predictors(max_context)
    df, x_ts, y_ts = candles(n_ctx)
    a = cached.predict(df, x_ts, y_ts[:pred_len], pred_len, top_k=1, verbose=False)
    b = plain.predict(df, x_ts, y_ts[:pred_len], pred_len, top_k=1, verbose=False)
    np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), rtol=1e-5, atol=1e-5)
    assert list(a.columns) == ["open", "high", "low", "close", "volume", "amount"]
    assert (a.index == pd.DatetimeIndex(y_ts[:pred_len])).all()


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_tokens_match_and_dropped_tokens_have_no_influence(use_cache):
    _, pred = tiny_models(seed=2)
    g = torch.Generator().manual_seed(0)
    s1 = torch.randint(0, 16, (3, 40), generator=g)
    s2 = torch.randint(0, 16, (3, 40), generator=g)
    stamps = torch.randint(0, 7, (3, 52, 5), generator=g)
    ref = generate_tokens(pred, s1, s2, stamps, 12, max_context=32, top_k=1, use_cache=False)
    out = generate_tokens(pred, s1, s2, stamps, 12, max_context=32, top_k=1, use_cache=use_cache)
    assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])
    # Tokens before the first window (positions < 40 - 32) never influence the forecast.
    s1_mod, s2_mod = s1.clone(), s2.clone()
    s1_mod[:, :8] = (s1_mod[:, :8] + 5) % 16
    s2_mod[:, :8] = (s2_mod[:, :8] + 3) % 16
    mod = generate_tokens(pred, s1_mod, s2_mod, stamps, 12, max_context=32, top_k=1, use_cache=use_cache)
    assert torch.equal(mod[0][:, 40:], ref[0][:, 40:]) and torch.equal(mod[1][:, 40:], ref[1][:, 40:])


def test_cached_greedy_tokens_equal_recompute_across_the_window_boundary():
    _, pred = tiny_models(seed=4)
    g = torch.Generator().manual_seed(1)
    s1, s2 = torch.randint(0, 16, (4, 10), generator=g), torch.randint(0, 16, (4, 10), generator=g)
    stamps = torch.randint(0, 7, (4, 40, 5), generator=g)
    a = generate_tokens(pred, s1, s2, stamps, 30, max_context=24, top_k=1, use_cache=True)
    b = generate_tokens(pred, s1, s2, stamps, 30, max_context=24, top_k=1, use_cache=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_sampling_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    torch.manual_seed(0)
    assert set(sample_from_logits(logits, top_k=2).unique().tolist()) == {0, 1}
    # top-p keeps the first token past the threshold: 0.5 < 0.6, 0.8 > 0.6 -> {0, 1}
    assert set(sample_from_logits(logits, top_k=0, top_p=0.6).unique().tolist()) == {0, 1}
    assert set(sample_from_logits(logits, top_k=0, top_p=0.4).unique().tolist()) == {0}
    assert set(sample_from_logits(logits, top_k=None, top_p=None).unique().tolist()) == {0, 1, 2, 3}
    assert sample_from_logits(logits, top_k=1).unique().tolist() == [0]
    # a low temperature sharpens towards the mode; a high one flattens
    cold = (sample_from_logits(logits, temperature=0.2, top_k=None, top_p=None) == 0).float().mean()
    hot = (sample_from_logits(logits, temperature=5.0, top_k=None, top_p=None) == 0).float().mean()
    assert cold > 0.85 and hot < 0.4
    with pytest.raises(ValueError, match="temperature"):
        sample_from_logits(logits, temperature=0)


def test_top_k_one_is_deterministic_and_top_k_none_works():
    cached, _ = predictors(64)
    df, x_ts, y_ts = candles(30)
    a = cached.predict(df, x_ts, y_ts[:6], 6, top_k=1, verbose=False)
    torch.manual_seed(123)
    b = cached.predict(df, x_ts, y_ts[:6], 6, top_k=1, verbose=False)
    pd.testing.assert_frame_equal(a, b)
    c = cached.predict(df, x_ts, y_ts[:6], 6, top_k=None, top_p=None, sample_count=2, verbose=False)
    assert c.shape == (6, 6) and np.isfinite(c.to_numpy()).all()


def test_samples_and_quantiles():
    cached, _ = predictors(64)
    df, x_ts, y_ts = candles(30)
    torch.manual_seed(0)
    fc = cached.predict(df, x_ts, y_ts[:5], 5, T=1.5, top_p=1.0, sample_count=20, verbose=False,
                        return_samples=True, quantiles=[0.1, 0.5, 0.9])
    assert isinstance(fc, Forecast)
    assert fc.samples.shape == (20, 5, 6)
    np.testing.assert_allclose(fc.mean.to_numpy(), fc.samples.mean(axis=0), rtol=1e-6)
    lo, mid, hi = (fc.quantiles[q].to_numpy() for q in (0.1, 0.5, 0.9))
    assert (lo <= mid + 1e-9).all() and (mid <= hi + 1e-9).all()
    assert (fc.samples.std(axis=0) > 0).any()  # the paths differ


def test_predict_batch_matches_single_predictions_greedy():
    cached, _ = predictors(64)
    frames = [candles(25, seed=s) for s in range(3)]
    batch = cached.predict_batch([f[0] for f in frames], [f[1] for f in frames], [f[2][:4] for f in frames], 4,
                                 top_k=1, verbose=False)
    for (df, x_ts, y_ts), out in zip(frames, batch):
        single = cached.predict(df, x_ts, y_ts[:4], 4, top_k=1, verbose=False)
        np.testing.assert_allclose(out.to_numpy(), single.to_numpy(), rtol=1e-5, atol=1e-4)


def test_missing_volume_and_amount_are_filled():
    cached, _ = predictors(64)
    df, x_ts, y_ts = candles(20)
    out = cached.predict(df[["open", "high", "low", "close"]], x_ts, y_ts[:3], 3, top_k=1, verbose=False)
    assert np.allclose(out[["volume", "amount"]].to_numpy(), 0.0, atol=1e-3)


def _bad(case):
    df, x_ts, y_ts = candles(20)
    y = y_ts[:3]
    if case == "missing price column":
        return (df.drop(columns="high"), x_ts, y, 3), r"no 'high' column.*columns: \['open', 'low'"
    if case == "negative price":
        df.loc[7, "low"] = -1.0
        return (df, x_ts, y, 3), r"df: column 'low' is <= 0 .* in 1 candle\(s\), first at row 7"
    if case == "high below low":
        df.loc[4, "high"] = df.loc[4, "low"] - 1
        return (df, x_ts, y, 3), r"column 'high' is below max\(open, close\) in 1 candle\(s\), first at row 4"
    if case == "one-row context":
        return (df.iloc[-1:], x_ts[-1:], y, 3), r"1 row\(s\) of context .* at least 2"
    if case == "pred_len beyond the window":
        long_y = pd.Series(pd.date_range(x_ts.iloc[-1] + pd.Timedelta("5min"), periods=65, freq="5min"))
        return (df, x_ts, long_y, 65), r"pred_len=65 is more than the predictor's window \(max_context=64\)"
    if case == "tz-aware history, naive future":
        return (df, x_ts.dt.tz_localize("UTC"), y, 3), r"tz-aware \(UTC\) but the forecast's are naive"
    if case == "nan":
        df.loc[5, "close"] = np.nan
        return (df, x_ts, y, 3), "NaN/inf"
    if case == "inf":
        df.loc[5, "volume"] = np.inf
        return (df, x_ts, y, 3), "NaN/inf"
    if case == "non-numeric":
        df["open"] = df["open"].astype(str)
        return (df, x_ts, y, 3), "non-numeric"
    if case == "timestamps not datetimes":
        return (df, x_ts.astype(str), y, 3), "must be datetimes"
    if case == "timestamps not increasing":
        return (df, x_ts.iloc[::-1].reset_index(drop=True), y, 3), "strictly increasing"
    if case == "y_timestamp length":
        return (df, x_ts, y_ts[:4], 3), "pred_len is 3"
    if case == "pred_len < 1":
        return (df, x_ts, y_ts[:0], 0), "pred_len must be"
    if case == "empty frame":
        return (df.iloc[:0], x_ts[:0], y, 3), "empty"
    if case == "x_timestamp length":
        return (df, x_ts[:10], y, 3), "x_timestamp has 10"
    if case == "forecast before context":
        return (df, x_ts, x_ts[-3:], 3), "must start after the context"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing price column", "nan", "inf", "non-numeric", "timestamps not datetimes",
                                  "timestamps not increasing", "y_timestamp length", "pred_len < 1", "empty frame",
                                  "x_timestamp length", "forecast before context", "negative price",
                                  "high below low", "one-row context", "pred_len beyond the window",
                                  "tz-aware history, naive future"])
def test_bad_input_is_a_clear_value_error(case):
    cached, _ = predictors(64)
    args, message = _bad(case)
    with pytest.raises(ValueError, match=message):
        cached.predict(*args, verbose=False)


def test_bad_input_is_refused_before_any_generation(monkeypatch):
    cached, _ = predictors(64)
    monkeypatch.setattr(cached, "generate", lambda *a, **k: pytest.fail("generated before refusing"))
    for case in ("pred_len beyond the window", "high below low", "tz-aware history, naive future"):
        args, message = _bad(case)
        with pytest.raises(DataError, match=message):
            cached.predict(*args, verbose=False)


def test_any_case_columns_are_read_and_a_short_context_is_said_once(caplog):
    cached, _ = predictors(64)
    df, x_ts, y_ts = candles(20)
    upper = df.rename(columns=str.title).rename(columns={"Volume": "vol"})  # Open/High/Low/Close, an alias
    a = cached.predict(upper, x_ts, y_ts[:3], 3, top_k=1, verbose=False)
    b = cached.predict(df, x_ts, y_ts[:3], 3, top_k=1, verbose=False)
    pd.testing.assert_frame_equal(a, b)
    with caplog.at_level("WARNING", logger="model.predictor"):
        for _ in range(2):
            cached.predict(df.iloc[-5:], x_ts[-5:], y_ts[:3], 3, top_k=1, verbose=False)
    assert [r.getMessage() for r in caplog.records if "little for the model" in r.getMessage()] == [
        "df has 5 rows of context, little for the model (up to 64: max_context: assumed, not known (no training "
        "window recorded; pass lookback=)); said once"]


def test_the_cut_says_whether_the_context_was_recorded_or_assumed(caplog):
    """Issue 48 item 2: a recorded training window is named as such; none recorded: max_context, assumed."""
    tok, pred = tiny_models(seed=1)
    df, x_ts, y_ts = candles(40)
    said = {}
    for name, kp in (("assumed", KronosPredictor.from_models(pred, tok, max_context=32, device="cpu")),
                     ("recorded", KronosPredictor.from_models(pred, tok, {"max_context": 32, "lookback": 24},
                                                              device="cpu")),
                     ("passed", KronosPredictor.from_models(pred, tok, {"lookback": 24}, lookback=20, device="cpu"))):
        caplog.clear()
        with caplog.at_level("WARNING", logger="model.predictor"):
            kp.predict(df, x_ts, y_ts[:3], 3, top_k=1, verbose=False)
        said[name] = next(r.getMessage() for r in caplog.records if "rows of history" in r.getMessage())
    assert "the last 32, max_context: assumed, not known (no training window recorded" in said["assumed"]
    assert "the last 24, the context the model was trained on (lookback)" in said["recorded"]
    assert "the last 20, lookback, as passed" in said["passed"] and "trained" not in said["passed"]


def test_predict_batch_rejects_mismatched_inputs():
    cached, _ = predictors(64)
    a, b = candles(20), candles(25, seed=1)
    with pytest.raises(ValueError, match="different lengths"):
        cached.predict_batch([a[0], b[0]], [a[1]], [a[2][:3], b[2][:3]], 3, verbose=False)
    with pytest.raises(ValueError, match="sample_count"):
        cached.predict(a[0], a[1], a[2][:3], 3, sample_count=0, verbose=False)


def test_stamp_features_of_many_indexes_equal_time_features_of_each():
    """The host side reads every series' stamps in one call (issue 48 item 8): the same numbers as one call each,
    whatever the unit and zone (each on its own wall clock, across a DST change)."""
    from model.features import time_features
    from model.predictor import stamp_features

    dst = pd.date_range("2024-03-09 22:00", periods=40, freq="37min", tz="America/New_York")
    indexes = [dst, dst.tz_convert("Asia/Tokyo").as_unit("s"), pd.date_range("1700-01-01", periods=5, freq="MS"),
               pd.bdate_range("2261-12-01", periods=7).as_unit("ms"), pd.DatetimeIndex([], dtype="M8[us]"),
               pd.date_range("2024-01-02 09:30", periods=3, freq="min").as_unit("us")]
    got = stamp_features(indexes)
    assert len(got) == len(indexes)
    for index, feats in zip(indexes, got):
        assert feats.dtype == np.float32
        np.testing.assert_array_equal(feats, time_features(index).astype(np.float32))
