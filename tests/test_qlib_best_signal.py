"""The Qlib report names the best signal by IC, with the walk-forward's interval against the runner-up, and says
so when a baseline beats every model (issue 32)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("qlib")
from finetune.qlib_test import best_signal  # noqa: E402


def test_a_baseline_that_beats_the_models_is_named_best():
    rng = np.random.default_rng(32)
    days, stocks = pd.bdate_range("2024-01-01", periods=120), [f"S{i:02d}" for i in range(30)]
    index = pd.MultiIndex.from_product([days, stocks], names=["datetime", "instrument"])
    label = pd.Series(rng.standard_normal(len(index)), index)
    labels = pd.DataFrame({"label_1": label})
    signals = {"close@seed0": label * 0.1 + rng.standard_normal(len(index)),  # a weak model
               "zeroshot": pd.Series(rng.standard_normal(len(index)), index),  # no skill
               "momentum": label + rng.standard_normal(len(index))}  # a strong baseline
    ic = {n: float(pd.concat([s, label], axis=1).groupby(level="datetime").corr().xs(0, level=1)[1].mean())
          for n, s in signals.items()}
    results = {n: {"headline": {"IC": ic[n]}, "horizon": 1} for n in signals}
    best = best_signal(signals, labels, results, ["momentum", "reversal"])
    assert best["signal"] == "momentum" and best["runner_up"] == "close@seed0"
    assert list(best["ranking"]) == ["momentum", "close@seed0", "zeroshot"]
    assert best["test"]["verdict"] == "helps" and best["test"]["ci_low"] > 0  # 120 days: an interval, above 0
    assert best["line"].startswith("best by IC: momentum") and "use it, or finetune more" in best["line"]
    # a model on top gets no baseline advice
    results["close@seed0"]["headline"]["IC"] = 1.0
    assert "finetune more" not in best_signal(signals, labels, results, ["momentum"])["line"]


def test_fewer_than_two_defined_signals_give_no_ranking():
    results = {"close@seed0": {"headline": {"IC": float("nan")}, "horizon": 1},
               "momentum": {"headline": {"IC": 0.1}, "horizon": 1}}
    best = best_signal({}, pd.DataFrame(), results, ["momentum"])
    assert best["signal"] == "momentum" and "no ranking" in best["line"]
