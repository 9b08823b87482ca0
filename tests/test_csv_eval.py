"""The CSV held-out evaluation end to end (finetune_csv/forecast.py) on tiny untrained models saved as a "run".

The windows are counted independently of the code under test: from the CSV row counts and the split ratios.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune.utils.errors import run_main
from finetune_csv import forecast
from finetune_csv.config import load
from model.errors import EXIT_CONFIG, EXIT_DATA, EXIT_PATH
from tests.model_factory import tiny_models, tiny_predictor

YAML = """
data: {{path: {data}, lookback: 24, predict: 6, train_ratio: 0.6, val_ratio: 0.2, test_ratio: 0.2, stride: 3,
       split: per_series}}
model: {{pretrained_tokenizer: {tok}, pretrained_predictor: {pred}}}
paths: {{exp_name: ev, base_dir: "{out}/out/{{exp_name}}"}}
forecast: {{{forecast}}}
"""


def make_run(root: Path, n_bars=(300, 251), zero_shot: str | None = "same", extra: str = "") -> Path:
    """Two series of different lengths, a tiny predictor saved as the run's best model, the tiny tokenizer as the
    starting tokenizer (the run never trained one: a bare tokenizer best_model/ would be an unfinished stage)."""
    frames = generate_ohlcv(n_series=2, n_bars=max(n_bars), freq="5min", seed=3)
    frames = {k: f.iloc[:n] for (k, f), n in zip(frames.items(), n_bars)}
    write_csv_folder(frames, root / "data")
    tok, pred = tiny_models(seed=0)
    tok.save_pretrained(root / "start/tokenizer")
    pred.save_pretrained(root / "out/ev/basemodel/best_model")
    start_tok, start_pred = root / "start/tokenizer", "null"
    if zero_shot == "same":  # a different starting predictor (other seed) with the same tokenizer
        tiny_predictor(seed=7).save_pretrained(root / "start/predictor")
        start_pred = root / "start/predictor"
    elif zero_shot is not None:
        start_pred = zero_shot
    config = root / "ev.yaml"
    # `extra` (", key: value, ...") overrides the forecast defaults: a YAML mapping may not repeat a key
    settings = {"sample_count": "8", "seed": "1"}
    settings.update(kv.split(": ", 1) for kv in (p.strip() for p in extra.split(", ")) if kv)
    forecast_yaml = ", ".join(f"{k}: {v}" for k, v in settings.items())
    config.write_text(YAML.format(data=root / "data", out=root, tok=start_tok, pred=start_pred, forecast=forecast_yaml))
    return config


def expected_test_windows(n_rows: int, lookback: int = 24, predict: int = 6, stride: int | None = None) -> int:
    """Non-overlapping windows of a series' test split, counted from the ratios (train 0.6, val 0.2)."""
    val_end = int(n_rows * 0.6) + int(n_rows * 0.2)
    test_rows = n_rows - val_end
    stride = stride or predict
    return (test_rows - predict) // stride + 1


def test_every_non_overlapping_test_window_is_scored(tmp_path):
    cfg = load(make_run(tmp_path))
    metrics = forecast.run_forecast(cfg)
    # Independent count (the code uses split_bounds; int(0.6 * 300) = 180, int(0.2 * 300) = 60 -> 60 test rows).
    assert expected_test_windows(300) == 10
    assert expected_test_windows(251) == 8  # 51 test rows: 8 full horizons + 3 rows
    n = expected_test_windows(300) + expected_test_windows(251)
    assert metrics["windows"] == n and metrics["finetuned"]["setup"]["windows"] == n
    assert metrics["finetuned"]["setup"]["samples"] == 8
    table = pd.read_csv(cfg.base_dir / "forecast" / "forecast.csv", parse_dates=["timestamps"])
    assert len(table) == n * 6
    # The forecast rows tile the test split: each test row of each series exactly once, up to the last full horizon.
    data = {p.stem: pd.read_csv(p, parse_dates=["timestamps"]) for p in (tmp_path / "data").glob("*.csv")}
    for name, frame in data.items():
        rows = table[table["series"].str.startswith(name)]
        assert rows["timestamps"].is_unique
        first_test = int(len(frame) * 0.6) + int(len(frame) * 0.2)
        expected = frame["timestamps"].iloc[first_test: first_test + len(rows)]
        assert list(rows["timestamps"]) == list(expected)
        np.testing.assert_allclose(rows["actual_close"], frame["close"].iloc[first_test: first_test + len(rows)])
    assert {"pred_close", "close_q10", "close_q90", "actual_close", "series"} <= set(table.columns)
    assert (table["close_q10"] <= table["close_q90"]).all()
    assert (cfg.base_dir / "forecast" / "forecast_vs_actual.png").stat().st_size > 0
    assert not list((cfg.base_dir / "forecast").glob("*.tmp*"))  # written whole, no temporary left


def test_metrics_json_holds_scores_baselines_intervals_and_the_zero_shot_comparison(tmp_path):
    cfg = load(make_run(tmp_path, extra=", season: 12"))
    metrics = forecast.run_forecast(cfg)
    on_disk = json.loads((cfg.base_dir / "forecast" / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics, allow_nan=False))  # strict JSON, nothing lost
    ft = on_disk["finetuned"]
    for key in ("mae", "mase", "crps", "wql", "coverage_50", "coverage_80", "direction_accuracy"):
        assert ft["model"]["overall"][key] is not None, key
    assert len(ft["model"]["per_horizon"]["mae"]) == 6 and len(ft["per_series"]) == 2
    assert ft["persistence"]["overall"]["coverage_80"] == 0.0  # a point forecast covers nothing
    assert ft["seasonal_naive"]["overall"]["mae"] is not None and ft["setup"]["season"] == 12
    ci = ft["intervals"]["crps"]  # the interval rule over few 5-minute sessions: no interval, and the reason
    assert ci["estimate"] == pytest.approx(ft["model"]["overall"]["crps"]) and ci["low"] is None
    assert "no 95% interval" in ci["reason"]
    # Zero-shot: another predictor on the same windows -> other scores, and a paired difference that adds up.
    zs = on_disk["zero_shot"]
    assert zs["setup"]["windows"] == ft["setup"]["windows"]
    diff = on_disk["finetuned_vs_zero_shot"]
    assert diff["crps"] == pytest.approx(ft["model"]["overall"]["crps"] - zs["model"]["overall"]["crps"])
    test = diff["test"]["crps"]  # the one interval rule: HAC-t over sessions (5-minute bars: few), no interval
    assert test["windows"] == ft["setup"]["windows"] and test["verdict"] == "no_evidence"
    assert "no 95% interval: only" in test["reason"]
    report = forecast.format_report(metrics)
    assert "finetuned vs zero-shot (raw bands, both): CRPS - zero-shot" in report and len(report.splitlines()) <= 18
    crps = {k: on_disk[k]["model"]["overall"]["crps"] for k in ("finetuned", "zero_shot", "ensemble") if on_disk[k]}
    crps |= {k: ft[k]["overall"]["crps"] for k in ("persistence", "empirical", "seasonal_naive") if k in ft}
    best = min(crps, key=crps.get)  # the verdict line names the best of all, models and baselines
    assert f"best by CRPS: {best.replace('_', '-')}" in report
    assert on_disk["series_without_test_windows"] == [] and "(SH600000.csv, SH600001.csv)" in report
    metrics["series_without_test_windows"] = ["NVDA.csv"]  # a date split that left NVDA without a test window
    assert "no test window: NVDA.csv" in forecast.format_report(metrics).splitlines()[0]


def test_the_same_seed_gives_the_same_scores(tmp_path):
    cfg = load(make_run(tmp_path, zero_shot=None))
    a = forecast.run_forecast(cfg, tmp_path / "a")
    b = forecast.run_forecast(cfg, tmp_path / "b")
    assert a == b and a["zero_shot"] is None


def test_window_stride_and_the_zero_shot_model_that_cannot_be_loaded(tmp_path, caplog):
    cfg = load(make_run(tmp_path, zero_shot=str(tmp_path / "missing-model"), extra=", window_stride: 3"))
    with caplog.at_level("WARNING", logger="finetune_csv.forecast"):
        metrics = forecast.run_forecast(cfg)
    assert metrics["windows"] == expected_test_windows(300, stride=3) + expected_test_windows(251, stride=3)
    assert metrics["zero_shot"] is None
    assert "seasonal_naive" not in metrics["finetuned"]  # inferred: 48 bars a day > data.lookback=24
    assert [r.message for r in caplog.records if "zero-shot comparison skipped" in r.message]


def _stderr_with_one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.startswith("error")]) == 1 and "Traceback" not in err, err
    return err


def test_no_trained_predictor_is_a_path_error_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    config = make_run(tmp_path)
    cfg = load(config)
    (cfg.predictor_dir / "best_model" / "config.json").unlink()
    assert run_main(forecast.main, ["--config", str(config)]) == EXIT_PATH
    assert "no trained predictor" in _stderr_with_one_error_line(capsys)
    assert not (cfg.base_dir / "forecast").exists()


@pytest.mark.parametrize("args, code, message", [
    (["--set", "data.val_ratio=0.4", "--set", "data.test_ratio=0"], EXIT_CONFIG, "data.test_ratio: is 0"),
    (["--future", "--set", "forecast.calendar={calendar}"], EXIT_DATA, "forecast.calendar: the first column"),
    (["--future", "--set", "data.lookback=260"], EXIT_DATA, "shorter than data.lookback=260"),  # a series: 251
])
def test_forecast_command_mistakes_exit_with_one_error_line(tmp_path, capsys, monkeypatch, args, code, message):
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    (tmp_path / "calendar.csv").write_text("")  # an empty file: no dates
    argv = ["--config", str(make_run(tmp_path, zero_shot=None))]
    assert run_main(forecast.main, argv + [a.format(calendar=tmp_path / "calendar.csv") for a in args]) == code
    assert message in _stderr_with_one_error_line(capsys)


def test_bad_forecast_settings_name_their_keys(tmp_path):
    config = make_run(tmp_path, extra=", window_stride: 0, max_windows: 0, "
                                      "calendar: nowhere.csv, sample_count: 0")
    with pytest.raises(ValueError) as err:
        load(config)
    for key in ("forecast.window_stride", "forecast.max_windows", "forecast.calendar",
                "forecast.sample_count"):
        assert key in str(err.value)


def test_future_forecast_writes_a_long_table_after_the_last_row(tmp_path):
    cfg = load(make_run(tmp_path, zero_shot=None))
    table = forecast.run_future(cfg)
    assert len(table) == 2 * 6 and list(table.columns[:2]) == ["series", "timestamps"]
    for name, part in table.groupby("series"):
        src = pd.read_csv(tmp_path / "data" / f"{name.split('.')[0]}.csv", parse_dates=["timestamps"])
        assert part["timestamps"].min() > src["timestamps"].max() and part["timestamps"].is_monotonic_increasing
    assert (table["close_q25"] <= table["close_q75"]).all()
    assert math.isfinite(table["pred_close"].sum())
    assert (cfg.base_dir / "future" / "forecast.png").stat().st_size > 0
    assert (cfg.base_dir / "future" / "forecast.csv").is_file()
