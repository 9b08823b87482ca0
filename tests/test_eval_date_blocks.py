"""Bootstrap intervals over blocks of window dates, and the `empirical` baseline in score_forecasts."""

from __future__ import annotations

import numpy as np
import pytest

from finetune.evaluation.forecast_scores import (
    ScoreSettings,
    crps_ensemble,
    empirical_samples,
    score_forecasts,
)
from finetune.evaluation.statistics import bootstrap_ci, date_block_indices, default_block


def test_two_perfectly_correlated_series_give_the_interval_of_one():
    rng = np.random.default_rng(0)
    dates = np.arange(120) * 86_400
    values = rng.normal(0.01, 0.05, size=120)  # one series' per-window score differences
    one = bootstrap_ci(lambda i: values[i].mean(), 120, n_boot=400, block=4, seed=3, dates=dates)
    both_values, both_dates = np.r_[values, values], np.r_[dates, dates]
    two = bootstrap_ci(lambda i: both_values[i].mean(), 240, n_boot=400, block=4, seed=3, dates=both_dates)
    assert (two["low"], two["high"], two["estimate"]) == pytest.approx((one["low"], one["high"], one["estimate"]))
    assert two["unit"] == "dates" and two["block"] == 4
    # Resampling the 240 windows independently would claim a narrower interval (by about sqrt 2).
    naive = bootstrap_ci(lambda i: both_values[i].mean(), 240, n_boot=400, block=1, seed=3)
    assert naive["high"] - naive["low"] < 0.85 * (one["high"] - one["low"])


def test_date_blocks_take_every_window_of_a_drawn_date_and_consecutive_dates():
    dates = np.array([5, 1, 3, 1, 5, 3, 7])  # windows of several series, unsorted
    for row in date_block_indices(dates, n_boot=20, block=2, seed=1):
        drawn = dates[row]
        for d in np.unique(drawn):  # each drawn date brings all its windows (once per draw)
            assert np.sum(drawn == d) % np.sum(dates == d) == 0
        assert len(row) >= len(dates) - 2  # 4 dates in blocks of 2: two blocks, 2 windows each at least


def test_default_block_grows_with_the_dates_and_keeps_overlapping_windows_together():
    assert default_block(27) == 3 and default_block(1000) == 10
    assert default_block(8, min_block=4) == 4  # windows closer than the horizon share realised bars


def test_empirical_baseline_is_scored_beside_persistence_with_intervals():
    rng = np.random.default_rng(2)
    w, s, h, t = 12, 16, 3, 60
    history = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, size=(w, t)), axis=1))  # (W, T) closes
    last = history[:, -1]
    realised = last[:, None] * np.exp(np.cumsum(rng.normal(0, 0.01, size=(w, h)), axis=1))
    samples = last[:, None, None] * np.exp(rng.normal(0, 0.02, size=(w, s, h)))
    settings = ScoreSettings(n_boot=50, empirical_window=40)
    out = score_forecasts(samples, realised, last, history[:, -20:], None, settings, history=history,
                          dates=np.arange(w))
    emp = empirical_samples(history, h, 40)  # (W, 40 - 3 + 1, H)
    assert out["setup"]["empirical_paths"] == 38 == emp.shape[1]
    obs = realised / last[:, None] - 1
    expected = crps_ensemble(obs, np.moveaxis(emp / last[:, None, None] - 1, 1, -1)).mean()
    assert out["empirical"]["overall"]["crps"] == pytest.approx(expected)
    versus = out["versus"]["empirical"]
    assert versus["mean"] == pytest.approx(out["model"]["overall"]["crps"] - expected)
    assert versus["dates"] == w
    assert "crps_vs_empirical" in out["skill"] and "crps_vs_persistence" in out["skill"]
