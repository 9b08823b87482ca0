"""The CRPS validation metric for checkpoint selection (finetune_csv/train_sequential.py), on tiny untrained models."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from finetune.evaluation.forecast_scores import ScoreSettings, score_forecasts
from finetune.evaluation.held_out import held_out_windows, sample_paths
from finetune_csv.config import CsvFinetuneConfig
from finetune_csv.pipeline import make_crps_val_metric
from model import KronosPredictor
from model.config import Window
from model.features import CLOSE
from tests.csv_reference import one_series_split
from tests.model_factory import tiny_models, tiny_predictor


def make_windows(n: int = 160, lookback: int = 16, predict: int = 4):
    rng = np.random.default_rng(0)
    close = 50 * np.exp(np.cumsum(rng.normal(0, 0.01, n)))
    values = np.column_stack([close, close * 1.01, close * 0.99, close, rng.uniform(1, 2, n) * 1e3,
                              rng.uniform(1, 2, n) * 5e4])  # (n, 6)
    ts = pd.date_range("2024-01-02 09:30", periods=n, freq="5min")
    return held_out_windows(one_series_split(values, ts, start=0, first_target=lookback, stop=n),
                            Window(lookback, predict))


def make_cfg() -> CsvFinetuneConfig:
    cfg = CsvFinetuneConfig()
    cfg.data.lookback, cfg.data.predict = 16, 4
    cfg.forecast.sample_count, cfg.forecast.seed = 6, 5
    return cfg


def test_the_score_is_the_mean_crps_of_the_subsample_and_is_deterministic():
    tok, pred = tiny_models(seed=0)
    cfg, windows = make_cfg(), make_windows()
    metric = make_crps_val_metric(cfg, windows, tok, max_windows=10)
    first = metric(pred)  # (the Validator keeps the training's random streams: test_engine_helpers.py)
    assert metric(pred) == first  # same weights, same score
    assert first["windows"] == 10 and first["samples"] == 6 and first["score"] == first["crps"] > 0

    # The same number from the held-out scorer on the same 10 windows (spread evenly, ends included).
    sub = windows.subset(np.unique(np.round(np.linspace(0, len(windows) - 1, 10)).astype(int)))
    kp = KronosPredictor(pred, tok, device="cpu", max_context=20, clip=cfg.data.clip)
    x_st, y_st = sub.stamps()
    paths = sample_paths(kp, sub.context, x_st, y_st, 4, cfg.forecast)
    ref = score_forecasts(paths[..., CLOSE], sub.actual[..., CLOSE], sub.context[:, -1, CLOSE],
                          settings=ScoreSettings())
    assert first["crps"] == pytest.approx(ref["model"]["overall"]["crps"], rel=1e-12)
    assert first["mae"] == pytest.approx(ref["model"]["overall"]["mae"], rel=1e-12)


def test_other_weights_get_another_score_and_the_training_mode_is_restored():
    tok, pred = tiny_models(seed=0)
    metric = make_crps_val_metric(make_cfg(), make_windows(), tok, max_windows=8)
    other = tiny_predictor(seed=9)
    other.train()
    assert metric(other)["score"] != metric(pred)["score"]
    assert other.training


def test_an_empty_validation_split_is_an_error_naming_select_by():
    tok, _ = tiny_models(seed=0)
    with pytest.raises(ValueError, match="select_by: loss"):
        make_crps_val_metric(make_cfg(), make_windows().subset(np.zeros(0, dtype=int)), tok)
