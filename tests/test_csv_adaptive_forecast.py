"""`kronos forecast` with forecast.calibration_method: adaptive on a tiny run: held-out windows replayed in time order,
the band-quality numbers in metrics.json, the end state kept in kronos_predictor.json for --future."""

import json

import numpy as np
import pytest

from finetune.evaluation.held_out import held_out_windows
from finetune_csv import forecast
from finetune_csv.config import load
from finetune_csv.pipeline import calibrate
from finetune_csv.prepare import prepare_data
from model.config import Window
from tests.test_csv_eval import make_run
from tests.test_csv_eval_candidates import record_tokenizer


@pytest.mark.slow
def test_adaptive_bands_are_scored_in_time_order_and_their_state_kept(tmp_path):
    cfg = load(make_run(tmp_path, zero_shot=None, extra=", calibration_method: adaptive, per_series: true"))
    best = record_tokenizer(cfg, tmp_path / "start/tokenizer")
    val = held_out_windows(prepare_data(cfg.data, cfg.store_dir).splits["val"], Window(24, 6), None)
    calibrate(best, val, cfg.forecast, Window(24, 6, cfg.data.clip))
    cal = forecast.run_forecast(cfg)["calibration"]
    assert cal["method"] == "adaptive" and 0 <= cal["cov80_calibrated"] <= 1 and 0 <= cal["cov80_split"] <= 1
    assert 0 < cal["width80_raw"] and 0 < cal["width80_calibrated"] < np.inf
    assert 0 <= cal["cov80_rolling_worst"] <= cal["cov80_calibrated"] + 1e-9 and len(cal["cov80_by_volatility"]) == 3
    state = json.loads((best / "kronos_predictor.json").read_text())["calibration"]["adaptive"]
    series = forecast.run_forecast(cfg)["series"]
    assert sorted(state["trackers"]) == series
    again = json.loads((best / "kronos_predictor.json").read_text())["calibration"]["adaptive"]
    assert again == state  # a rerun replays from the split margins: the same end state
    table = forecast.run_future(cfg, tmp_path / "future")
    assert set(table["series"]) == set(series) and (table["close_q90"] > table["close_q10"]).all()


@pytest.mark.slow
def test_finetuned_and_zero_shot_are_compared_with_the_same_bands(tmp_path):
    cfg = load(make_run(tmp_path))
    best = record_tokenizer(cfg, tmp_path / "start/tokenizer")
    val = held_out_windows(prepare_data(cfg.data, cfg.store_dir).splits["val"], Window(24, 6), None)
    calibrate(best, val, cfg.forecast, Window(24, 6, cfg.data.clip))
    metrics = forecast.run_forecast(cfg)
    assert metrics["finetuned_vs_zero_shot"]["bands"] == "calibrated"  # zero-shot's margins fitted on val too
    assert metrics["finetuned_raw_vs_zero_shot"]["bands"] == "raw"
    ft, zs = metrics["finetuned"]["model"]["overall"]["crps"], metrics["zero_shot"]["model"]["overall"]["crps"]
    assert metrics["finetuned_vs_zero_shot"]["crps"] == pytest.approx(ft - zs)
    report = forecast.format_report(metrics)
    assert "finetuned vs zero-shot (calibrated bands, both)" in report
    assert "finetuned vs zero-shot (raw bands, both)" in report
    raw = forecast.run_forecast(load(make_run(tmp_path, extra=", calibrate: false")), tmp_path / "raw")
    assert raw["finetuned_vs_zero_shot"]["bands"] == "raw" and "finetuned_raw_vs_zero_shot" not in raw


@pytest.mark.parametrize("bands", ["raw", "calibrated"])
def test_the_verdict_line_says_which_bands_finetuned_and_zero_shot_were_compared_on(bands):
    block = lambda crps: {"model": {"overall": {"crps": crps, "samples": 8}}}  # noqa: E731
    metrics = {"finetuned": {**block(0.2), "versus": {}}, "zero_shot": block(0.1),
               "finetuned_vs_zero_shot": {"bands": bands, "test": {"crps": {"reason": "no evidence"}}}}
    line = forecast.ranking(metrics)
    assert line.startswith("best by CRPS: zero-shot") and f"against finetuned ({bands} bands, both): " in line
