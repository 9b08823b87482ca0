"""The adaptive bands on report.html in chromium (as tests/test_report_browser.py): coverage over time of the raw,
split and adaptive bands in time order, the band widths, and finetuned vs zero-shot labelled with the bands both
sides had; no console error, nothing wider than a 1,400 px viewport. Skipped without playwright or chromium."""

from __future__ import annotations

import json

import numpy as np
import pytest

from finetune.evaluation.held_out import held_out_windows
from finetune.evaluation.report import write_report
from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune_csv import forecast
from finetune_csv.config import load
from finetune_csv.pipeline import calibrate
from finetune_csv.prepare import prepare_data
from model.config import Window
from tests.test_csv_eval import make_run
from tests.test_csv_eval_candidates import record_tokenizer
from tests.test_report import other_runs
from tests.test_report_browser import browser, check_layout, open_page  # noqa: F401 - the chromium fixture

pytestmark = pytest.mark.slow


def test_coverage_over_time_and_like_with_like_on_the_page(browser, tmp_path):  # noqa: F811
    config = make_run(tmp_path, n_bars=(600, 600), extra=", calibration_method: adaptive")
    write_csv_folder(generate_ohlcv(n_series=2, n_bars=600, freq="1D", seed=3), tmp_path / "data")
    cfg = load(config)
    best = record_tokenizer(cfg, tmp_path / "start/tokenizer")
    val = held_out_windows(prepare_data(cfg.data, cfg.store_dir).splits["val"], Window(24, 6), None)
    calibrate(best, val, cfg.forecast, Window(24, 6, cfg.data.clip))
    metrics = forecast.run_forecast(cfg)
    cal, run = metrics["calibration"], cfg.base_dir / "forecast"
    over = cal["cov80_over_time"]
    assert cal["method"] == "adaptive" and {"raw", "split", "calibrated"} <= set(over)
    assert len(over["time"]) == len(over["raw"]) and over["time"] == sorted(over["time"])
    assert min(over["calibrated"]) == pytest.approx(cal["cov80_rolling_worst"])
    page, requests, errors = open_page(browser, (run / "report.html").resolve().as_uri())
    page.wait_for_selector("#coverage-over-time .main-svg")
    assert errors == [] and len(set(requests)) == 1
    check_layout(page, run)
    legend = page.locator("#coverage-over-time .legendtext").all_text_contents()
    assert legend == ["raw", "split", "adaptive"]
    assert page.locator("#coverage-over-time .main-svg").first.bounding_box()["width"] > 100
    assert f"{cal['width80_calibrated']:.4f}" in page.inner_text("#band-quality")
    row = page.locator('#differences tr[data-a="finetuned"][data-b="zero_shot"] td').first.inner_text()
    assert row.endswith("(calibrated bands, both)") and metrics["finetuned_vs_zero_shot"]["bands"] == "calibrated"
    assert "(raw bands, both)" in page.inner_text("#raw-bands")
    assert "(calibrated bands, both)" in forecast.format_report(metrics)
    page.close()

    # a walk-forward's report.json and a tune's tune/report.json with their band fields
    # (walk_forward.calibration_fields): the same chart on both pages
    runs = other_runs(tmp_path / "runs")
    for folder, path in ((runs["walk_forward"], runs["walk_forward"] / "report.json"),
                         (runs["tune"], runs["tune"] / "tune" / "report.json")):
        report = json.loads(path.read_text())
        rng, when = np.random.default_rng(0), np.arange(120).astype("datetime64[D]")
        report["calibration"] = {"method": "adaptive", **forecast.band_quality(
            {"raw": rng.random(120) < 0.5, "calibrated": rng.random(120) < 0.8},
            {"raw": np.ones(120), "calibrated": 2 * np.ones(120)}, rng.random(120), when)}
        path.write_text(json.dumps(report))
        page, requests, errors = open_page(browser, write_report(folder).resolve().as_uri())
        assert errors == [] and page.locator("#coverage-over-time .legendtext").all_text_contents() == [
            "raw", "adaptive"], folder
        check_layout(page, folder)
        page.close()
