"""Calibration belongs to the sampling it was fitted with (issue 47 item 1): a changed forecast.sample_count, T,
top_k or top_p is refused in `kronos forecast` and the Python API, refitted in the walk-forward's and tune's folds."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from finetune_csv import train_sequential
from finetune_csv.config import load
from finetune_csv.forecast import run_forecast
from model import KronosPredictor
from model.calibration import fit_calibration
from model.errors import EXIT_REFUSED, RefusedError
from tests import model_factory
from tests.test_csv_train import make_run


def test_the_api_refuses_a_calibration_fitted_with_other_sampling_naming_the_setting():
    rng = np.random.default_rng(0)
    last = np.full(8, 100.0)
    cal = fit_calibration(
        100 * np.exp(rng.normal(0, 0.01, (8, 4, 3)).cumsum(-1)),
        100 * np.exp(rng.normal(0, 0.01, (8, 3)).cumsum(-1)),
        last,
    )
    tok, model = model_factory.tiny_models()
    predictor = KronosPredictor(
        model,
        tok,
        device="cpu",
        max_context=32,
        calibration={**cal, "decoding": {"T": 1.0, "top_k": 0, "top_p": 0.9, "sample_count": 4}},
    )
    stamps = pd.Series(pd.date_range("2024-01-01", periods=19, freq="D"))
    frame = pd.DataFrame(100 + rng.normal(0, 1, (16, 4)).cumsum(0), columns=["open", "high", "low", "close"])
    frame["high"], frame["low"] = frame.max(axis=1) + 1, frame.min(axis=1) - 1
    call = lambda n, **kw: predictor.predict(
        frame, stamps[:16], stamps[16:], pred_len=3, sample_count=n, verbose=False, **kw
    )
    with pytest.raises(RefusedError, match="sample_count 4 -> 6") as err:
        call(6)
    assert err.value.exit_code == EXIT_REFUSED
    assert call(4).shape == (3, 6) and call(6, calibrated=False).shape == (3, 6)


@pytest.mark.slow
def test_kronos_forecast_refuses_margins_fitted_with_4_samples_for_6_sample_forecasts(tmp_path):
    config = make_run(tmp_path)
    assert train_sequential.main(["--config", str(config), "--set", "forecast.sample_count=4"]) == 0
    with pytest.raises(RefusedError, match=r"sample_count 4 -> 6.*forecast.calibrate=false"):
        run_forecast(load(config, ["forecast.sample_count=6"]))
    assert not (tmp_path / "out/tiny/forecast").exists()
    assert run_forecast(load(config, ["forecast.sample_count=4"]))["calibration"] is not None
    # kronos finetune with the new sampling reuses the trained stages and refits the calibration under it
    assert train_sequential.main(["--config", str(config), "--set", "forecast.sample_count=6"]) == 0
    info = json.loads((tmp_path / "out/tiny/basemodel/best_model/kronos_predictor.json").read_text())
    assert info["calibration"]["decoding"]["sample_count"] == 6
    shutil.rmtree(tmp_path / "out/tiny/forecast")  # the 4-sample forecast: never replaced by one of other settings
    assert run_forecast(load(config, ["forecast.sample_count=6"]))["calibration"] is not None
