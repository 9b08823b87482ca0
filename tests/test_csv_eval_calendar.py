"""`kronos forecast --future` on real-looking calendars (FX 24/5 hours, stock business days) and its early refusals:
a calibration shorter than data.predict, calibration margins that are no calibration, the --help line."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from finetune.synthetic import write_csv_folder
from finetune.utils.errors import run_main
from finetune_csv import forecast
from finetune_csv.config import load
from model.errors import EXIT_CONFIG, EXIT_DATA
from model.predictor import PREDICTOR_INFO_NAME
from tests.test_csv_eval import make_run
from tests.test_model_calendar import fx_hours, weekly_slots


def ohlcv(stamps: pd.DatetimeIndex, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    close = 100 * np.exp(np.cumsum(rng.normal(0, 0.002, len(stamps))))
    open_ = np.r_[close[0], close[:-1]]
    return pd.DataFrame({"timestamps": stamps, "open": open_, "high": np.maximum(open_, close) * 1.001,
                         "low": np.minimum(open_, close) * 0.999, "close": close,
                         "volume": rng.uniform(1e3, 2e3, len(stamps)), "amount": close * 1e3})


def run_on(tmp_path, frames: dict[str, pd.DataFrame]):
    config = make_run(tmp_path, zero_shot=None)
    for old in (tmp_path / "data").glob("*.csv"):
        old.unlink()
    write_csv_folder(frames, tmp_path / "data")
    return config


def test_future_fx_hours_after_a_friday_are_hours_the_market_trades(tmp_path, capsys):
    history = fx_hours("2024-01-07 21:00", "2024-03-01 16:00")  # ends Friday 16:00
    config = run_on(tmp_path, {"EURUSD": ohlcv(history, 0)})
    assert forecast.main(["--config", str(config), "--set", "data.predict=24", "--future"]) == 0
    got = pd.DatetimeIndex(pd.read_csv(load(config).base_dir / "future" / "forecast.csv",
                                       parse_dates=["timestamps"])["timestamps"])
    assert len(got) == 24 and weekly_slots(got) <= weekly_slots(history)
    assert got[3] == pd.Timestamp("2024-03-01 20:00") and got[4] == pd.Timestamp("2024-03-03 21:00")
    assert "to 2024-03-04 16:00:00" in capsys.readouterr().out


def test_future_daily_stock_bars_are_the_business_days_after_the_last_bar(tmp_path):
    days = pd.bdate_range("2023-01-02", "2024-03-15").difference(pd.DatetimeIndex(["2023-12-25", "2024-01-01"]))
    config = run_on(tmp_path, {"STOCK": ohlcv(days, 1)})
    table = forecast.run_future(load(config))
    assert list(pd.DatetimeIndex(table["timestamps"])) == list(pd.bdate_range("2024-03-18", periods=6))


def _calibrate(config, margins):
    info_path = load(config).predictor_dir / "best_model" / PREDICTOR_INFO_NAME
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    info["calibration"] = {"method": "conformal", "space": "log_return", "levels": [0.5, 0.9], "margins": margins}
    info_path.write_text(json.dumps(info))
    return info_path


def test_a_calibration_shorter_than_data_predict_is_refused_before_sampling(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    config = make_run(tmp_path, zero_shot=None)
    _calibrate(config, [[0.01] * 6, [0.02] * 6])
    monkeypatch.setattr(forecast, "sample_paths", lambda *a, **k: pytest.fail("sampled before refusing"))
    argv = ["--config", str(config), "--set", "data.predict=10", "--future"]
    assert run_main(forecast.main, argv) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "data.predict: is 10" in err and "--set forecast.calibrate=false" in err and "Traceback" not in err
    assert not (load(config).base_dir / "future").exists()


@pytest.mark.parametrize("margin", [1e3, -1e6, float("nan")])
def test_calibration_margins_that_are_no_calibration_are_refused_at_load(tmp_path, capsys, monkeypatch, margin):
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    config = make_run(tmp_path, zero_shot=None)
    info_path = _calibrate(config, [[0.01] * 6, [0.02] * 5 + [margin]])
    assert run_main(forecast.main, ["--config", str(config), "--future"]) == EXIT_DATA
    err = capsys.readouterr().err
    assert f"{info_path}: calibration margins must be finite and within [-5, 5] (log_return units" in err
    assert "Traceback" not in err and not (load(config).base_dir / "future").exists()


def test_forecast_help_opens_with_what_the_command_does(capsys):
    with pytest.raises(SystemExit):
        forecast.main(["--help"])
    assert "Forecast with a finetuned CSV run" in capsys.readouterr().out.split("\n\n")[1]
