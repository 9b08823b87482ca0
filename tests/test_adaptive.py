"""Adaptive conformal bands (model/adaptive.py) on seeded synthetic returns: a model N(0, 1%) whose test-time truth
changes scale after calibration; split margins fitted with fit_calibration on 500 validation windows."""

import numpy as np
import pytest
from scipy.stats import norm

import model.adaptive as adaptive
from model.calibration import CALIBRATION_LEVELS, fit_calibration

L80 = CALIBRATION_LEVELS.index(0.8)
H, W = 5, 500


def replay(seed, cal_sd, test_sd, series=("a",), per_series=False):
    """(split 80% coverage, adaptive coverage per window (W,), adaptive / split mean 80% width, state, names)."""
    rng = np.random.default_rng(seed)
    samples = np.exp(rng.normal(0, 0.01, (500, 100, H)))
    cal = fit_calibration(samples, np.exp(rng.normal(0, cal_sd * 0.01, (500, H))), np.ones(500))
    names = [series[i % len(series)] for i in range(W)]
    sd = np.asarray([test_sd[series.index(n)] if isinstance(test_sd, tuple) else test_sd for n in names])
    y = rng.normal(0, 1, (W, H)) * sd[:, None] * 0.01
    q = np.asarray([norm.ppf(lv) for lv in adaptive.SCORE_LEVELS])[:, None] * np.full(H, 0.01)  # (21, H)
    scores = adaptive.band_scores(np.broadcast_to(q, (W, *q.shape)), y)  # (W, L, H)
    state = adaptive.start_state(cal, list(series) if per_series else None)
    t = np.arange(W) // len(series)  # every series forecast at each origin, its outcomes one bar apart
    margins = adaptive.replay(state, scores, t, t[:, None] + np.arange(1, H + 1), names)
    split = np.asarray(cal["margins"])[L80]
    cover = (scores[:, L80] <= margins[:, L80]).mean(axis=1)
    return (scores[:, L80] <= split).mean(), cover, (1 + margins[:, L80]).mean() / (1 + split).mean(), state, names


@pytest.mark.parametrize("seed", range(3))
def test_stationary_control_keeps_coverage_and_width(seed):
    split, cover, width, state, _ = replay(seed, 1.0, 1.0)
    assert abs(cover.mean() - 0.80) <= 0.03 and width <= 1.05
    assert np.isfinite(adaptive.tracker_margins(state)).all()


@pytest.mark.parametrize("cal_sd, test_sd", [(1.0, 2.0), (1.0, 0.5), (2.0, 1.0)])  # vol x2, x0.5; too narrow
def test_adaptive_recovers_where_split_is_off(cal_sd, test_sd):
    split, cover, _, _, _ = replay(0, cal_sd, test_sd)
    assert abs(split - 0.80) >= 0.10
    assert abs(cover.mean() - 0.80) <= 0.03
    assert np.convolve(cover, np.ones(50) / 50, "valid").min() >= 0.65


def test_margins_stay_finite_and_keep_a_band():
    _, _, _, state, _ = replay(1, 1.0, 50.0)  # outcomes 50x the bands: the margins saturate, never explode
    m = adaptive.tracker_margins(state)
    assert np.isfinite(m).all() and (m >= -0.9).all() and (m <= 5.0).all()


def test_outcome_used_only_once_published():
    state = adaptive.start_state(
        {
            "method": "conformal",
            "space": "band",
            "levels": list(CALIBRATION_LEVELS),
            "margins": [[0.0] * 2] * len(CALIBRATION_LEVELS),
        }
    )
    scores = np.full((2, len(CALIBRATION_LEVELS), 2), 9.0)  # every outcome a miss
    margins = adaptive.replay(state, scores, np.array([0, 1]), np.array([[1, 2], [2, 3]]), ["a", "a"])
    assert (margins[0] == 0).all()  # nothing published by t=0
    assert (margins[1, :, 0] > 0).all() and (margins[1, :, 1] == 0).all()  # step 1 of window 0 arrived at t=1 only
    assert state["trackers"]["*"]["n"] == [2, 2]  # all four outcomes fed by the end


def test_per_series_covers_each_series():
    _, cover, _, _, names = replay(2, 1.0, (0.6, 1.6), series=("calm", "wild"), per_series=True)
    for name in ("calm", "wild"):
        assert abs(cover[np.asarray(names) == name].mean() - 0.80) <= 0.04


def test_a_series_without_its_own_tracker_gets_the_split_margins_not_an_error():
    """Per-series state only for the series that had held-out windows: a forecast for another (a series without test
    windows, an id a served request names) applies the split margins; a tracked series its own, moved ones."""
    r = np.random.default_rng(0)
    cal = fit_calibration(100 * np.exp(r.normal(0, 0.01, (40, 30, 3))), 100 * np.exp(r.normal(0, 0.02, (40, 3))),
                          np.full(40, 100.0))
    state = adaptive.start_state(cal, ["A"])
    state["trackers"]["A"]["q"] = (np.asarray(state["trackers"]["A"]["q"]) + 0.5).tolist()
    stored = {**cal, "adaptive": state}
    other = adaptive.current_calibration(stored, "B")
    assert "adaptive" not in other and np.allclose(other["margins"], cal["margins"])
    assert not np.allclose(adaptive.current_calibration(stored, "A")["margins"], cal["margins"])
