"""Issue 39's acceptance, through the functions the reports call: a ranking that does not depend on the sample count
(score_forecasts + the forecast's ranking line), calibrated bands that reach nominal (model.calibration), and a
coverage check whose error bar respects dependence (forecast_scores.coverage_test)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from finetune.evaluation.forecast_scores import (
    ScoreSettings,
    coverage_test,
    crps_ensemble,
    empirical_samples,
    interval_coverage,
    score_forecasts,
)
from finetune.evaluation.statistics import mean_interval
from finetune_csv.forecast import ranking
from model.calibration import apply_calibration, fit_calibration

HORIZON, SIGMA = 16, 0.01  # 250 bars of history -> the empirical baseline's 235 paths, as in the issue


def perfect_vs_empirical(rng, windows: int) -> dict:
    """score_forecasts, as `kronos forecast` calls it, of a perfect 20-sample model (draws from the true random walk)
    on `windows` non-overlapping windows of one daily series, each with the trailing 250 bars as the empirical
    baseline's history."""
    closes = 100 * np.exp(np.cumsum(rng.normal(0, SIGMA, 251 + windows * HORIZON)))  # one series
    ends = 250 + HORIZON * np.arange(windows)  # (W,) last context bar of each window
    history = closes[ends[:, None] - 250 + np.arange(251)]  # (W, 251)
    last, realised = closes[ends], closes[ends[:, None] + 1 + np.arange(HORIZON)]  # (W,), (W, H)
    draws = last[:, None, None] * np.exp(np.cumsum(rng.normal(0, SIGMA, (windows, 20, HORIZON)), axis=-1))
    dates = pd.bdate_range("2020-01-01", periods=len(closes))[ends].to_numpy()
    return score_forecasts(draws, realised, last, history[:, -20:], None, ScoreSettings(),
                           history=history, dates=dates)


@pytest.mark.parametrize("replications,windows", [pytest.param(100, 100, marks=pytest.mark.slow), (4, 250)])
def test_a_perfect_20_sample_model_is_named_best_against_the_empirical_baseline(replications, windows):
    # The plain CRPS named the empirical baseline (235 paths) best 80% of the time at 100 windows and 96% at 400
    # (issue 39; here 81% at 100): it overstates a 20-sample ensemble's CRPS by about 5%. The fair one: the perfect
    # model is named best 87% of the time at 100 windows (150 replications), never significantly worse.
    rng = np.random.default_rng(39)
    named, worse = [], []
    for _ in range(replications):
        out = perfect_vs_empirical(rng, windows)
        line = ranking({"finetuned": out})
        named.append(line.startswith("best by CRPS: finetuned"))
        worse.append(out["versus"]["empirical"]["verdict"] == "hurts")
        assert "[S=20]" in line and "[S=235]" in line and "[S=1]" in line  # every forecaster's sample count shown
    assert np.mean(named) >= (0.8 if windows == 100 else 3 / 4)
    assert np.mean(worse) <= 0.05


def test_the_fair_crps_does_not_depend_on_the_sample_count_and_scores_a_point_forecast_exactly():
    rng = np.random.default_rng(0)
    obs = rng.standard_normal(4000)
    small, large = rng.standard_normal((4000, 5)), rng.standard_normal((4000, 500))
    fair = [crps_ensemble(obs, s, fair=True).mean() for s in (small, large)]
    plain = [crps_ensemble(obs, s).mean() for s in (small, large)]
    assert fair[0] == pytest.approx(fair[1], rel=0.03) and plain[0] > 1.08 * plain[1]
    point = rng.standard_normal((4000, 1))
    np.testing.assert_allclose(crps_ensemble(obs, point, fair=True), np.abs(obs - point[:, 0]))


def test_the_empirical_baseline_is_scored_by_the_fair_crps_beside_persistence():
    rng = np.random.default_rng(2)
    w, s, h, t = 12, 16, 3, 60
    history = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, size=(w, t)), axis=1))  # (W, T) closes
    last = history[:, -1]
    realised = last[:, None] * np.exp(np.cumsum(rng.normal(0, 0.01, size=(w, h)), axis=1))
    samples = last[:, None, None] * np.exp(rng.normal(0, 0.02, size=(w, s, h)))
    out = score_forecasts(samples, realised, last, history[:, -20:], None, ScoreSettings(empirical_window=40),
                          history=history, dates=np.arange(w))
    emp = empirical_samples(history, h, 40)  # (W, 40 - 3 + 1, H)
    obs = realised / last[:, None] - 1
    expected = crps_ensemble(obs, np.moveaxis(emp / last[:, None, None] - 1, 1, -1), fair=True).mean()
    assert out["empirical"]["overall"]["crps"] == pytest.approx(expected)
    assert out["empirical"]["overall"]["samples"] == 38 and out["model"]["overall"]["samples"] == 16
    assert out["empirical"]["overall"]["crps_plain"] > expected
    assert out["versus"]["empirical"]["mean"] == pytest.approx(out["model"]["overall"]["crps"] - expected)
    # 12 dates: too few for an interval, so metrics.json holds none (no bootstrap without a minimum)
    assert out["intervals"]["crps"]["low"] is None and "no 95% interval" in out["intervals"]["crps"]["reason"]


def half_width_draws(rng, windows: int, samples: int = 60, horizons: int = 2):
    """A model whose log-return bands are half the true width: paths N(0, 0.01^2 h), outcomes N(0, 0.02^2 h)."""
    scale = np.sqrt(np.arange(1, horizons + 1))
    last = rng.uniform(50, 150, windows)
    paths = last[:, None, None] * np.exp(rng.normal(0, 0.01, (windows, samples, horizons)) * scale)
    outcomes = last[:, None] * np.exp(rng.normal(0, 0.02, (windows, horizons)) * scale)
    return paths, outcomes, last


@pytest.mark.parametrize("replications", [pytest.param(200, marks=pytest.mark.slow), 40])
@pytest.mark.parametrize("windows", [10, 50, 200])
def test_half_width_bands_reach_80_percent_from_10_calibration_windows(windows, replications):
    # With shrinkage toward the raw bands by W / (W + 20) they covered 62%, 73% and 77% (issue 39).
    rng = np.random.default_rng(windows)
    covered = []
    for _ in range(replications):
        calibration = fit_calibration(*half_width_draws(rng, windows))
        paths, outcomes, last = half_width_draws(rng, 100)
        ens = np.moveaxis(apply_calibration(calibration, paths, last) / last[:, None, None] - 1, 1, -1)
        covered.append(interval_coverage(outcomes / last[:, None] - 1, ens, 0.8).mean())
    assert abs(np.mean(covered) - 0.8) <= (0.03 if replications >= 200 else 0.04)


def test_too_few_windows_for_a_level_are_reported_not_hidden():
    calibration = fit_calibration(*half_width_draws(np.random.default_rng(1), 10))
    assert calibration["too_few_windows"] == [0.95]  # rank ceil(11 * 0.95) = 11 > 10 windows
    assert fit_calibration(*half_width_draws(np.random.default_rng(1), 19))["too_few_windows"] == []


def correct_band_hits(rng, runs: int, days: int, horizon: int = 5) -> np.ndarray:
    """(runs, days, horizon) hits of correct 80% bands on overlapping daily windows (stride 1 day, `horizon`-day
    paths) under clustered volatility (log-volatility AR(1), phi 0.95, the bands knowing it): window d covers the
    cumulative return over days d+1..d+h."""
    log_vol = np.empty((runs, days + horizon + 1))
    log_vol[:, 0] = rng.normal(0, 1, runs)
    for t in range(1, log_vol.shape[1]):
        log_vol[:, t] = 0.95 * log_vol[:, t - 1] + np.sqrt(1 - 0.95**2) * rng.standard_normal(runs)
    vol = np.exp(log_vol)  # a 20-fold spread of daily volatility, in clusters
    ret = vol * rng.standard_normal(vol.shape)
    cum = np.stack([ret[:, d + 1:d + 1 + horizon].cumsum(-1) for d in range(days)], 1)  # (runs, days, H)
    sd = np.stack([np.sqrt((vol[:, d + 1:d + 1 + horizon] ** 2).cumsum(-1)) for d in range(days)], 1)
    return (np.abs(cum) <= 1.2816 * sd).astype(np.float64)  # the true 80% band


@pytest.mark.slow
def test_correct_bands_are_flagged_about_5_percent_under_clustered_volatility_and_overlap():
    rng = np.random.default_rng(7)
    hits = correct_band_hits(rng, 2000, 250)
    r = mean_interval(hits.mean(axis=2) - 0.8, flat=4)  # what coverage_test computes, vectorised over runs
    flagged = (r["has_interval"] & (np.abs(r["mean"]) > r["half"])).mean()
    assert 0.04 <= flagged <= 0.07  # the binomial error over sessions flagged 43-46% with overlapping windows


def test_the_coverage_check_flags_wrong_bands_and_passes_correct_ones():
    rng = np.random.default_rng(8)
    hits = correct_band_hits(rng, 60, 200)  # (60, 200, 5)
    dates = pd.date_range("2021-01-04", periods=200, freq="B").to_numpy()
    verdicts = [coverage_test(run, dates, 0.8, lag=4)["verdict"] for run in hits]
    assert np.mean([v != "no_evidence" for v in verdicts]) <= 0.1
    narrow = coverage_test(hits[0] * (rng.random(hits[0].shape) < 0.8), dates, 0.8, lag=4)  # covers ~64%
    assert narrow["verdict"] == "under" and "band coverage - nominal" in narrow["reason"]
