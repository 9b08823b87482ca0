"""finetune.evaluation forecast scores: scoring rules against reference packages and hand computations."""

import json

import numpy as np
import pandas as pd
import pytest

from finetune.evaluation.forecast_scores import (
    ScoreSettings,
    crps_ensemble,
    infer_season,
    interval_coverage,
    persistence_samples,
    pinball_loss,
    sample_quantiles,
    score_forecasts,
    seasonal_naive_samples,
    weighted_quantile_loss,
)
from model.fileio import strict_json


def _brute_crps(y, x, fair):
    n = len(x)
    pairs = np.abs(x[:, None] - x[None, :]).sum() / (n * (n - 1) if fair else n * n)
    return np.abs(x - y).mean() - 0.5 * pairs


def test_crps_matches_reference_packages_and_brute_force():
    rng = np.random.default_rng(3)
    ens = rng.normal(size=(4, 5, 7))  # (W, H, S)
    obs = rng.normal(size=(4, 5))
    properscoring = pytest.importorskip("properscoring")
    scoringrules = pytest.importorskip("scoringrules")
    np.testing.assert_allclose(crps_ensemble(obs, ens), properscoring.crps_ensemble(obs, ens), rtol=1e-12)
    np.testing.assert_allclose(crps_ensemble(obs, ens), scoringrules.crps_ensemble(obs, ens, estimator="nrg"),
                               rtol=1e-12)
    np.testing.assert_allclose(crps_ensemble(obs, ens, fair=True),
                               scoringrules.crps_ensemble(obs, ens, estimator="fair"), rtol=1e-12)
    assert crps_ensemble(obs, ens)[1, 2] == pytest.approx(_brute_crps(obs[1, 2], ens[1, 2], False), rel=1e-12)
    assert crps_ensemble(obs, ens, fair=True)[0, 0] == pytest.approx(_brute_crps(obs[0, 0], ens[0, 0], True))
    # A one-member ensemble is a point forecast: CRPS = absolute error, by either estimator.
    for fair in (False, True):
        np.testing.assert_allclose(crps_ensemble(np.array([1.0, 2.0]), np.array([[1.5], [0.0]]), fair=fair), [0.5, 2])
    with pytest.raises(ValueError, match="obs shape"):
        crps_ensemble(obs, ens[:3])


def test_pinball_wql_and_coverage_by_hand():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    obs, fc = rng.normal(size=50), rng.normal(size=(50, 3))
    qs = (0.1, 0.5, 0.9)
    loss = pinball_loss(obs, fc, qs)
    for j, q in enumerate(qs):
        assert loss[:, j].mean() == pytest.approx(sklearn_metrics.mean_pinball_loss(obs, fc[:, j], alpha=q))
    # Two observations, one level q = 0.5: losses 0.5 * |2 - 1| and 0.5 * |-1 - 1| -> 2 * 1.5 / 3 = 1.
    assert weighted_quantile_loss(np.array([2.0, -1.0]), np.array([[1.0], [1.0]]), (0.5,)) == pytest.approx(1.0)
    ens = np.tile(np.arange(1.0, 11.0), (4, 1))  # samples 1..10: 50% interval [3.25, 7.75], 80% [1.9, 9.1]
    obs = np.array([3.25, 8.0, 2.0, 9.5])
    np.testing.assert_array_equal(interval_coverage(obs, ens, 0.5), [1, 0, 0, 0])
    np.testing.assert_array_equal(interval_coverage(obs, ens, 0.8), [1, 1, 1, 0])
    np.testing.assert_allclose(sample_quantiles(ens, (0.5,))[:, 0], 5.5)


def test_baselines_and_season():
    ctx = np.array([[1.0, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(seasonal_naive_samples(ctx, 5, 2)[0, 0], [5, 6, 5, 6, 5])
    np.testing.assert_array_equal(persistence_samples(np.array([6.0, 7.0]), 3)[:, 0], [[6, 6, 6], [7, 7, 7]])
    with pytest.raises(ValueError, match="shorter than one season"):
        seasonal_naive_samples(ctx, 3, 7)
    five_min = pd.date_range("2024-01-02 09:30", periods=48, freq="5min").append(
        pd.date_range("2024-01-03 09:30", periods=48, freq="5min"))
    assert infer_season(five_min) == 48
    assert infer_season(pd.bdate_range("2024-01-01", periods=30)) == 5
    with pytest.raises(ValueError, match="set it explicitly"):
        infer_season(pd.date_range("2024-01-01", periods=10, freq="W"))


def _run(seed=0, w=40, s=30, h=4, level=(100.0, 1.0)):
    """Two series (prices ~100 and ~1) of random-walk windows with a calibrated forecaster."""
    rng = np.random.default_rng(seed)
    series = np.repeat(["A", "B"], w // 2)
    price = np.where(series == "A", *level)
    context = price[:, None] * np.exp(np.cumsum(rng.normal(0, 0.01, size=(w, 20)), axis=1))
    last = context[:, -1]
    realised = last[:, None] * np.exp(np.cumsum(rng.normal(0, 0.01, size=(w, h)), axis=1))
    samples = last[:, None, None] * np.exp(np.cumsum(rng.normal(0, 0.01, size=(w, s, h)), axis=2))
    return samples, realised, last, context, series


def test_score_forecasts_by_hand_and_strict_json():
    samples, realised, last, context, series = _run()
    out = score_forecasts(samples, realised, last, context, series, ScoreSettings(season=5))
    json.dumps(out, allow_nan=False)
    obs_ret = realised / last[:, None] - 1
    # Persistence predicts a zero return: its MAE and CRPS are the mean |return|.
    np.testing.assert_allclose(out["persistence"]["per_horizon"]["mae"], np.abs(obs_ret).mean(axis=0))
    np.testing.assert_allclose(out["persistence"]["per_horizon"]["crps"], np.abs(obs_ret).mean(axis=0))
    # Model MAE uses the sample median as the point forecast.
    med = np.median(samples / last[:, None, None] - 1, axis=1)
    assert out["model"]["overall"]["mae"] == pytest.approx(np.abs(med - obs_ret).mean())
    # MASE: each series' MAE over its mean in-sample |one-step return|, series weighted equally.
    scale = {k: np.abs(np.diff(context[series == k], axis=1) / context[series == k][:, :-1]).mean() for k in "AB"}
    mase = np.mean([np.abs(med - obs_ret)[series == k].mean() / scale[k] for k in "AB"])
    assert out["model"]["overall"]["mase"] == pytest.approx(mase)
    assert [r["series"] for r in out["per_series"]] == ["A", "B"] and out["per_series"][0]["windows"] == 20
    up = (obs_ret[:, -1] > 0).mean()
    assert out["direction"]["majority_class"] == pytest.approx(max(up, 1 - up))
    assert out["persistence"]["overall"]["direction_accuracy"] is None
    assert 0.3 < out["model"]["overall"]["coverage_80"] <= 1 and len(out["model"]["per_horizon"]["coverage_50"]) == 4
    assert set(out["model"]["overall"]["pinball"]) == {"0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9"}
    assert out["seasonal_naive"]["overall"]["mase"] > 0 and "crps_plain" in out["model"]["overall"]
    versus = out["versus"]["persistence"]  # the one interval rule: statistics.paired_test
    assert versus["mean"] == pytest.approx(out["model"]["overall"]["crps"] - out["persistence"]["overall"]["crps"])
    assert versus["windows"] == 40 and "CRPS model - persistence" in versus["reason"]
    assert out["skill"]["crps_vs_persistence"] == pytest.approx(
        1 - out["model"]["overall"]["crps"] / out["persistence"]["overall"]["crps"])


def test_scores_do_not_depend_on_price_level_and_perfect_forecast_scores_zero():
    a = score_forecasts(*_run(level=(100.0, 1.0)), settings=ScoreSettings())
    b = score_forecasts(*_run(level=(5000.0, 0.1)), settings=ScoreSettings())
    for key in ("mae", "mase", "crps", "wql"):
        assert a["model"]["overall"][key] == pytest.approx(b["model"]["overall"][key])
    _, realised, last, context, series = _run()
    perfect = score_forecasts(np.repeat(realised[:, None], 3, axis=1), realised, last, context, series,
                              ScoreSettings())
    assert perfect["model"]["overall"]["mae"] == 0 and perfect["model"]["overall"]["crps"] == pytest.approx(0)
    assert perfect["model"]["overall"]["direction_accuracy"] == 1.0


def test_flat_series_and_bad_inputs():
    samples, realised, last, context, series = _run()
    context[series == "B"] = 1.0  # a flat context: no naive error, MASE undefined -> None (strict JSON)
    last = last.copy()
    last[series == "B"] = 1.0
    out = score_forecasts(samples, realised, last, context, series, ScoreSettings())
    assert out["per_series"][1]["mase"] is None and out["per_series"][0]["mase"] > 0
    assert strict_json({"x": np.float32("nan"), "y": [np.inf, np.int64(2)]}) == {"x": None, "y": [None, 2]}
    with pytest.raises(ValueError, match=r"realised must be \(windows, horizons\)"):
        score_forecasts(samples, realised[:, :2], last)
    with pytest.raises(ValueError, match="must be finite"):
        score_forecasts(samples, np.where(realised > 0, np.nan, realised), last)
    with pytest.raises(ValueError, match="needs the context"):
        score_forecasts(samples, realised, last, settings=ScoreSettings(season=5))


def test_each_series_gets_its_own_seasonal_period():
    from types import SimpleNamespace

    from finetune_csv.forecast import _season
    from tests.test_walk_forward import panel

    daily = pd.bdate_range("2024-01-01", periods=60).as_unit("ns").asi8  # the panel keeps int64 ns
    hourly = pd.date_range("2024-03-01", periods=24 * 10, freq="1h").as_unit("ns").asi8  # a 24/7 market: 24 bars a day
    p = panel([60, 240], ["2024-03-22", "2024-03-10 23:00"])
    p.datetimes[:] = np.r_[daily, hourly]
    cfg = lambda season, lookback: SimpleNamespace(forecast=SimpleNamespace(season=season),
                                                   data=SimpleNamespace(lookback=lookback))
    assert _season(cfg(None, 48), p) == {"s0": 5, "s1": 24}  # not 24 trading days for the daily one
    assert _season(cfg(None, 16), p) is None  # the hourly season exceeds the lookback: no baseline
    assert _season(cfg(3, 16), p) == {"s0": 3, "s1": 3}
    context = np.arange(2 * 30, dtype=np.float64).reshape(2, 30)
    out = seasonal_naive_samples(context, 6, np.array([5, 24]))  # (W, 1, H): each window repeats its own season
    np.testing.assert_array_equal(out[0, 0], context[0, [25, 26, 27, 28, 29, 25]])
    np.testing.assert_array_equal(out[1, 0], context[1, 6:12])
    rng = np.random.default_rng(0)
    last = np.ones(2)
    scored = score_forecasts(1 + 0.01 * rng.standard_normal((2, 4, 6)), np.ones((2, 6)), last, 1 + context / 100,
                             np.array(["s0", "s1"]), ScoreSettings(season={"s0": 5, "s1": 24}))
    assert scored["setup"]["season"] == {"s0": 5, "s1": 24} and "seasonal_naive" in scored


def test_the_per_series_leak_warning_names_the_other_series_period_as_it_is(caplog):
    from finetune.utils.windows import PanelSegments
    from finetune_csv.splits import _warn_overlapping_periods
    from tests.test_walk_forward import panel

    # a daily series over 2023 and an hourly one over ten days of 2024, each cut 70/15/15 by its own rows
    daily = pd.bdate_range("2023-01-02", periods=200).as_unit("ns").asi8
    hourly = pd.date_range("2024-03-01", periods=240, freq="1h").as_unit("ns").asi8
    p = panel([200, 240], ["2024-03-22", "2024-03-10 23:00"])
    p.datetimes[:] = np.r_[daily, hourly]
    at = lambda pct: np.array([pct * 200 // 100, 200 + pct * 240 // 100])  # (S,) panel columns at pct % of rows
    (t0, t1), (v0, v1), (s0, s1) = (at(0), at(70)), (at(70), at(85)), (at(85), at(100))
    _warn_overlapping_periods({"train": PanelSegments(p, t0, t0, t1), "val": PanelSegments(p, v0, v0, v1),
                               "test": PanelSegments(p, s0, s0, s1)})
    # the daily validation period (from 2023-07) precedes the hourly training period (2024-03-01 .. 03-08), which
    # must be named with its own start, not as if it contained 2023-07
    assert "the val period of s0 begins 2023-07-17 00:00:00, before the train period of s1 (2024-03-01 00:00:00 .. " \
           "2024-03-07 23:00:00) ends" in caplog.text
