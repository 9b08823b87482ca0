"""`kronos forecast` beside its baselines and candidates: the empirical baseline from history beyond the lookback,
the ensemble, calibrated bands, repaired candles, the tokenizer recorded with the predictor, unfinished stages."""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pandas as pd
import pytest

import model.calibration as calibration_module
from finetune.evaluation.held_out import held_out_windows
from finetune_csv import forecast
from finetune_csv.config import load
from finetune_csv.pipeline import calibrate
from finetune_csv.prepare import prepare_data
from model import KronosTokenizer
from model.config import Window
from model.errors import ConfigError, UserError
from model.fileio import seal, write_json
from model.hub import weights_fingerprint
from model.predictor import predictor_info
from tests.model_factory import tiny_tokenizer
from tests.test_csv_eval import make_run


def test_the_empirical_baseline_uses_history_beyond_the_lookback_and_the_ensemble_is_scored(tmp_path):
    cfg = load(make_run(tmp_path))
    metrics = forecast.run_forecast(cfg)
    ft = metrics["finetuned"]
    # The shorter series (251 rows) has 150 + 50 = 200 rows before its first test bar (lookback is only 24):
    # 199 one-bar steps, so 199 - 6 + 1 = 194 six-bar paths (of the 250 asked for).
    assert ft["setup"]["empirical_paths"] == 194
    assert ft["empirical"]["overall"]["crps"] > 0 and ft["empirical"]["overall"]["coverage_80"] > 0
    assert ft["versus"]["empirical"]["windows"] == ft["setup"]["windows"]
    assert metrics["ensemble"]["weight"] == 0.5 and metrics["ensemble"]["setup"]["samples"] == 8
    ens, fin, zs = (metrics[k]["model"]["overall"]["crps"] for k in ("ensemble", "finetuned", "zero_shot"))
    assert metrics["ensemble_vs_zero_shot"]["crps"] == pytest.approx(ens - zs)
    report = forecast.format_report(metrics)
    assert "empirical" in report and "ensemble" in report and "invalid sampled candles" in report


def test_ensemble_paths_take_the_weighted_share_of_each_model():
    f, z = np.ones((3, 10, 4)), np.zeros((3, 10, 4))
    assert forecast.ensemble_paths(f, z, 0.5)[:, :, 0].sum(axis=1).tolist() == [5, 5, 5]
    assert forecast.ensemble_paths(f, z, 0.26)[0, :, 0].sum() == 3  # round(2.6)
    np.testing.assert_array_equal(forecast.ensemble_paths(f, z, 0.0), z)
    np.testing.assert_array_equal(forecast.ensemble_paths(f, z, 1.0), f)


def test_repair_candles_makes_every_sampled_candle_valid_and_says_so(tmp_path):
    cfg = load(make_run(tmp_path, zero_shot=None, extra=", repair_candles: true"))
    metrics = forecast.run_forecast(cfg)
    assert metrics["candle_violations"]["any"] > 0  # what the model sampled, before the repair
    table = pd.read_csv(cfg.base_dir / "forecast" / "forecast.csv")
    for q in ("10", "50", "90"):  # each quantile of high / low lies outside the same quantile of open and close
        assert (table[f"high_q{q}"] >= np.maximum(table[f"open_q{q}"], table[f"close_q{q}"]) - 1e-9).all()
        assert (table[f"low_q{q}"] <= np.minimum(table[f"open_q{q}"], table[f"close_q{q}"]) + 1e-9).all()
    assert "repaired" in forecast.format_report(metrics)
    paths = np.random.default_rng(0).normal(100, 1, size=(2, 3, 4, 6))
    fixed = forecast.repair_candles(paths)
    assert forecast.candle_violations(*(fixed[..., i] for i in range(4)), np.abs(fixed[..., 4]))["any"] == 0


def fake_calibration(monkeypatch, seen: dict, widen: float = 50.0):
    """Stand-ins of model.calibration's functions (same signatures and file format): a band widened by
    `widen` around the median."""
    def fit(samples, outcomes, last):
        seen.update(samples=samples, outcomes=outcomes, last=last)
        h = samples.shape[2]
        return {"method": "conformal", "space": "log_return", "levels": [0.5, 0.8], "margins": [[0.1] * h] * 2,
                "windows": len(samples)}

    def write(path, calibration):
        info = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**info, "calibration": calibration}))
        seal(path.parent)  # as the real one re-seals the best model

    def apply(calibration, samples, last):
        med = np.median(samples, axis=-2, keepdims=True)
        return np.maximum(med + widen * (samples - med), 1e-3)

    for name, fn in (("fit_calibration", fit), ("write_calibration", write), ("apply_calibration", apply)):
        monkeypatch.setattr(calibration_module, name, fn)


def test_calibration_is_fitted_on_validation_windows_and_coverage_reported_before_and_after(tmp_path, monkeypatch):
    seen: dict = {}
    fake_calibration(monkeypatch, seen)
    cfg = load(make_run(tmp_path, zero_shot=None))
    best = record_tokenizer(cfg, tmp_path / "start/tokenizer")
    val = held_out_windows(prepare_data(cfg.data, cfg.store_dir).splits["val"], Window(24, 6),
                           cfg.forecast.window_stride)
    calibrate(best, val, cfg.forecast, Window(24, 6, cfg.data.clip))
    # Validation windows only: 10 + 8 of them, the first realised closes are rows 180.. of the longer series.
    assert seen["samples"].shape == (18, 8, 6)
    frames = [pd.read_csv(p) for p in sorted((tmp_path / "data").glob("*.csv"))]
    firsts = [f["close"].iloc[int(len(f) * 0.6): int(len(f) * 0.6) + 6].to_numpy() for f in frames]
    assert any(np.allclose(seen["outcomes"][0], first, rtol=1e-6) for first in firsts)
    stored = json.loads((cfg.predictor_dir / "best_model" / "kronos_predictor.json").read_text())
    assert stored["calibration"]["windows"] == 18
    metrics = forecast.run_forecast(cfg)
    cal = metrics["calibration"]
    assert cal["cov80_raw"] < 0.5 and cal["cov80_calibrated"] > 0.9 and cal["cov50_calibrated"] >= cal["cov50_raw"]
    # Held-out coverage beside the nominal, then each band's coverage minus nominal by the interval rule
    # (5-minute bars: few sessions, so no interval and no flag); an interval off nominal is flagged.
    report = forecast.format_report(metrics)
    assert "(nominal 0.50 / 0.80)" in report and "80% band coverage - nominal" in report
    assert cal["test_80"]["verdict"] == "no_evidence" and "off nominal" not in report
    cal["test_80"]["verdict"] = "over"
    assert "calibrated coverage off nominal at 80% (its interval excludes 0)" in forecast.format_report(metrics)
    # forecast.csv: the calibrated bands under their own names, the raw ones beside them (the page draws both)
    table = pd.read_csv(cfg.base_dir / "forecast" / "forecast.csv")
    width = lambda pre: (table[f"{pre}close_q90"] - table[f"{pre}close_q10"]).mean()  # noqa: E731
    assert width("raw_") < width("") and {"close_q50", "raw_close_q50", "raw_high_q25"} <= set(table.columns)
    assert "raw_close_q10" in (cfg.base_dir / "forecast" / "report.html").read_text()
    assert {"close_q10", "raw_close_q10"} <= set(forecast.run_future(cfg, tmp_path / "future").columns)
    off = forecast.run_forecast(load(make_run(tmp_path, zero_shot=None, extra=", calibrate: false")),
                                tmp_path / "raw")
    assert off["calibration"] is None
    assert not [c for c in pd.read_csv(tmp_path / "raw" / "forecast.csv").columns if c.startswith("raw_")]


def record_tokenizer(cfg, tokenizer_dir, sha256: str | None = None):
    """What the stage runner writes beside a trained predictor: its tokenizer and that tokenizer's weights' sha256."""
    best = cfg.predictor_dir / "best_model"
    sha256 = sha256 or weights_fingerprint(KronosTokenizer.from_pretrained(tokenizer_dir))
    write_json(best / "kronos_predictor.json", predictor_info(best, max_context=30, tokenizer=tokenizer_dir,
                                                              tokenizer_sha256=sha256))
    seal(best)  # as the stage runner does after every write into best_model/
    return best


def test_a_tokenizer_other_than_the_one_the_predictor_was_trained_with_is_refused_naming_both(tmp_path):
    cfg = load(make_run(tmp_path, zero_shot=None))
    record_tokenizer(cfg, tmp_path / "start/tokenizer", "0" * 64)
    right = weights_fingerprint(KronosTokenizer.from_pretrained(tmp_path / "start/tokenizer"))
    with pytest.raises(UserError, match=f"tokenizer weights sha256 000000000000 .* has sha256 {right[:12]}"):
        forecast.run_forecast(cfg)
    assert not (cfg.base_dir / "forecast").exists()
    record_tokenizer(cfg, tmp_path / "start/tokenizer")
    assert forecast.run_forecast(cfg)["windows"] == 18


def test_a_forecast_cutting_other_windows_than_the_predictor_learned_on_is_refused_by_name(tmp_path):
    cfg = load(make_run(tmp_path, zero_shot=None))
    best = record_tokenizer(cfg, tmp_path / "start/tokenizer")
    info = json.loads((best / "kronos_predictor.json").read_text())
    write_json(best / "kronos_predictor.json", {**info, "lookback": 24, "clip": 3.0})  # trained with clip 3
    seal(best)
    with pytest.raises(ConfigError, match=r"data\.clip: is 5\.0 but the predictor in .* was trained with 3\.0"):
        forecast.run_forecast(cfg)
    assert not (cfg.base_dir / "forecast").exists()
    write_json(best / "kronos_predictor.json", {**info, "lookback": 24, "clip": 5.0})
    seal(best)
    assert forecast.run_forecast(cfg)["windows"] == 18


def test_the_recorded_tokenizer_is_used_even_when_the_run_now_has_another(tmp_path, caplog):
    cfg = load(make_run(tmp_path, zero_shot=None))
    before = forecast.run_forecast(cfg, tmp_path / "a")
    best = cfg.predictor_dir / "best_model"
    (best / "kronos_predictor.json").write_text(json.dumps({"max_context": 30, "tokenizer": "../../../../start/"
                                                                                           "tokenizer"}))
    tiny_tokenizer(seed=5).save_pretrained(cfg.tokenizer_dir / "best_model")  # a newer tokenizer in the run
    with caplog.at_level("WARNING", logger="finetune_csv.forecast"):
        after = forecast.run_forecast(cfg, tmp_path / "b")
    assert after["finetuned"] == before["finetuned"]
    assert any("was trained with tokenizer" in r.message for r in caplog.records)
    (best / "kronos_predictor.json").write_text(json.dumps({"max_context": 30, "tokenizer": "gone/tokenizer"}))
    with pytest.raises(UserError, match="kronos_predictor.json"):
        forecast.run_forecast(cfg, tmp_path / "c")


def test_forecasting_a_running_or_unfinished_predictor_stage_warns(tmp_path, caplog):
    cfg = load(make_run(tmp_path, zero_shot=None))
    (cfg.predictor_dir / "run.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                            "started": "now", "argv": "train"}))
    with caplog.at_level("WARNING", logger="finetune_csv.forecast"):
        forecast.run_future(cfg)
    assert any("still running" in r.message for r in caplog.records)
    (cfg.predictor_dir / "run.lock").unlink()
    (cfg.predictor_dir / "metrics.jsonl").write_text("")
    caplog.clear()
    with caplog.at_level("WARNING", logger="finetune_csv.forecast"):
        forecast.run_future(cfg)
    assert any("did not finish" in r.message for r in caplog.records)


def test_daily_plot_titles_show_dates_without_midnight():
    past = pd.date_range("2024-01-01", periods=10, freq="D")
    future = pd.date_range("2024-01-11", periods=3, freq="D")
    panel = forecast._panels(["A"], [past], np.ones((1, 10)), [future], np.ones((1, 2, 3, 6)))[0]
    assert panel.title == "A: close from 2024-01-11 to 2024-01-13"
    past = pd.date_range("2024-01-02 09:00", periods=6, freq="5min")
    future = pd.date_range("2024-01-02 09:30", periods=3, freq="5min")
    panel = forecast._panels(["A"], [past], np.ones((1, 6)), [future], np.ones((1, 2, 3, 6)))[0]
    assert panel.title == "A: close from 2024-01-02 09:30 to 2024-01-02 09:40"
