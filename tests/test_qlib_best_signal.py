"""The Qlib report names the best signal by IC, with the walk-forward's interval against the runner-up, and says
so when a baseline beats every model (issue 32)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("qlib")
from finetune.qlib_test import best_signal  # noqa: E402


def _market(rng, days: int = 120, stocks: int = 30):
    days_, names = pd.bdate_range("2024-01-01", periods=days), [f"S{i:02d}" for i in range(stocks)]
    index = pd.MultiIndex.from_product([days_, names], names=["datetime", "instrument"])
    noise = lambda: pd.Series(rng.standard_normal(len(index)), index)  # noqa: E731
    return noise, noise()


def test_a_baseline_that_beats_the_models_is_named_best():
    rng = np.random.default_rng(32)
    noise, label = _market(rng)
    labels = pd.DataFrame({"label_1": label})
    signals = {"close@seed0": label * 0.1 + noise(),  # a weak model
               "close@zeroshot": noise(),  # no skill
               "momentum": label + noise()}  # a strong baseline
    results = {n: {"headline": {"IC": 0.0}, "horizon": 1} for n in signals}
    best = best_signal(signals, labels, results, ["momentum", "reversal"])
    assert best["signal"] == "momentum" and best["runner_up"] == "close"  # one seed: the model's one entry
    assert list(best["ranking"]) == ["momentum", "close", "close@zeroshot"]
    assert best["test"]["verdict"] == "helps" and best["test"]["ci_low"] > 0  # 120 days: an interval, above 0
    assert best["line"].startswith("best by IC at h=1: momentum") and "use it, or finetune more" in best["line"]
    signals["close@seed0"] = label * 3 + noise()  # a model on top gets no baseline advice
    assert "finetune more" not in best_signal(signals, labels, results, ["momentum"])["line"]


def test_seeds_are_one_entry_and_every_signal_is_ranked_at_one_horizon():
    rng = np.random.default_rng(39)
    noise, label1 = _market(rng)
    label5 = label1 + noise()  # another label horizon, on which only the momentum signal is informative
    labels = pd.DataFrame({"label_1": label1, "label_5": label5})
    signals = {"last@seed0": label1 * 0.5 + noise(), "last@seed1": label1 * 0.5 + noise(),
               "momentum": (label5 - label1) + noise()}
    results = {n: {"headline": {"IC": 0.0}, "horizon": 1 if n == "momentum" else 5} for n in signals}
    best = best_signal(signals, labels, results, ["momentum"])
    assert best["horizon"] == 5 and set(best["ranking"]) == {"last", "momentum"}  # two seeds, one entry
    assert best["seeds"] == {"last": 2} and "seeds averaged" in best["line"]
    daily = {n: pd.concat([s, label5], axis=1).groupby(level="datetime").corr().xs(0, level=1)[1] for n, s in
             signals.items()}
    assert best["ranking"]["last"] == pytest.approx((daily["last@seed0"] + daily["last@seed1"]).mean() / 2)


def test_fewer_than_two_defined_signals_give_no_ranking():
    results = {"close@seed0": {"headline": {"IC": float("nan")}, "horizon": 1},
               "momentum": {"headline": {"IC": 0.1}, "horizon": 1}}
    best = best_signal({}, pd.DataFrame(), results, ["momentum"])
    assert best["signal"] == "momentum" and "no ranking" in best["line"]
