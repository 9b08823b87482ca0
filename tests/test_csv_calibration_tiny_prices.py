"""Calibration works where forecasting works (issue 38): a panel with a series priced 3e-7 of the other calibrates;
windows whose sampled closes reach <= 0 are left out by series name, and a run where none is left says why in one
line and in kronos_predictor.json, with advice that can succeed (not "re-run kronos finetune")."""
import json
import logging

import numpy as np
import pandas as pd
import pytest

import finetune_csv.pipeline as pipeline
from finetune.evaluation.held_out import held_out_windows
from finetune_csv.config import load
from finetune_csv.prepare import prepare_data
from model import KronosPredictor
from model.config import Window
from tests.test_csv_eval import make_run
from tests.test_csv_eval_candidates import record_tokenizer


def rescale(cfg, tmp_path, factor: float):
    """Prices of the first series x factor (3e-7: an altcoin in BTC); (best_model, its validation windows, name)."""
    tiny = sorted((tmp_path / "data").glob("*.csv"))[0]
    frame = pd.read_csv(tiny)
    prices = [c for c in frame.columns if c.lower() in ("open", "high", "low", "close", "amount")]
    frame[prices] *= factor
    frame.to_csv(tiny, index=False)
    best = record_tokenizer(cfg, tmp_path / "start/tokenizer")
    return best, held_out_windows(prepare_data(cfg.data, cfg.store_dir).splits["val"], Window(24, 6), None), tiny.name


@pytest.fixture
def run(tmp_path):
    cfg = load(make_run(tmp_path, zero_shot=None))
    return cfg, *rescale(cfg, tmp_path, 3e-7)


def stored(best) -> dict:
    return json.loads((best / "kronos_predictor.json").read_text())


@pytest.mark.slow
def test_a_tiny_priced_panel_calibrates_as_in_ordinary_units(run, tmp_path):
    cfg, best, val, _ = run
    assert pipeline.calibrate(best, val, cfg.forecast, Window(24, 6, cfg.data.clip)) is not None
    cal = stored(best)["calibration"]
    assert cal["windows"] == len(val) and "excluded" not in cal
    KronosPredictor.from_pretrained(best)  # loads and checks it
    best, val, _ = rescale(cfg, tmp_path, 1 / 3e-7)  # the same panel in its ordinary units: the same margins
    ordinary = pipeline.calibrate(best, val, cfg.forecast, Window(24, 6, cfg.data.clip))
    np.testing.assert_allclose(cal["margins"], ordinary["margins"], atol=0.05)


def test_windows_crossing_zero_are_left_out_by_series_and_none_left_is_a_recorded_verdict(run, monkeypatch, caplog):
    cfg, best, val, tiny = run
    first = np.array([n == tiny for n in val.names])

    def paths(predictor, context, x, y, predict, sampling, batch):  # (W, S, P, 6) around the last close
        out = np.repeat(context[:, -1:, None, :], predict, axis=2).repeat(8, axis=1) \
            * np.random.default_rng(0).lognormal(0, 0.01, (len(context), 8, predict, 1))
        out[first if monkeypatch.crossing == "some" else slice(None), 0, -1, 3] = -1.0
        return out

    monkeypatch.setattr(pipeline, "sample_paths", paths)
    monkeypatch.crossing = "some"
    with caplog.at_level(logging.WARNING, logger="finetune_csv"):
        assert pipeline.calibrate(best, val, cfg.forecast, Window(24, 6, cfg.data.clip)) is not None
    cal = stored(best)["calibration"]
    assert cal["excluded"] == {tiny: int(first.sum())} and cal["windows"] == int((~first).sum())
    assert f"{tiny} ({int(first.sum())})" in caplog.text
    monkeypatch.crossing = "all"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="finetune_csv"):
        assert pipeline.calibrate(best, val, cfg.forecast, Window(24, 6, cfg.data.clip)) is None
    verdict = stored(best)["calibration_failed"]
    assert "calibration" not in stored(best)  # the earlier one is not kept beside the verdict
    assert sorted(verdict["series"]) == sorted(set(val.names)) and "forecast.calibrate: false" in verdict["advice"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "forecast.calibrate: false" in lines[0] and "kronos finetune" not in lines[0]
