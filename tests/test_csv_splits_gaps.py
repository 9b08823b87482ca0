"""Splits against the run that was trained (finetune_csv/forecast.py, splits.py): a date split forecasts its own test
windows, a moved split scores only what the run never saw, an earlier forecast folder is never replaced silently;
splits and gaps in the data are named (prepare.py)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune.utils.errors import run_main
from finetune_csv import forecast, train_sequential
from finetune_csv.config import load
from model.errors import EXIT_REFUSED
from tests.test_csv_train import TINY_YAML

# the ratios say no test (test_ratio 0): the dates alone make it
DATE_SPLIT = ["data.train_end=2024-01-05", "data.val_end=2024-01-08", "data.train_ratio=0.85", "data.val_ratio=0.15",
              "data.test_ratio=0", "forecast.max_windows=null", "forecast.sample_count=4"]


@pytest.fixture(scope="module")
def date_run(tmp_path_factory):
    """Two series of 240 five-minute bars (2024-01-02 .. 01-08, 48 a day) trained with a date split: validation
    from 2024-01-05, test from 2024-01-08."""
    root = tmp_path_factory.mktemp("date_run")
    write_csv_folder(generate_ohlcv(n_series=2, n_bars=240, freq="5min", seed=0), root / "data")
    config = root / "tiny.yaml"
    config.write_text(TINY_YAML.format(data=root / "data", out=root / "out"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_sequential.main(["--config", str(config), *sum((["--set", s] for s in DATE_SPLIT), [])]) == 0
    finally:
        torch.set_num_threads(threads)
    return config


def forecast_table(config, name: str = "forecast") -> pd.DataFrame:
    return pd.read_csv(config.parent / "out" / "tiny" / name / "forecast.csv", parse_dates=["timestamps"])


def test_a_date_split_run_forecasts_the_test_windows_of_its_dates(date_run, capsys):
    argv = ["--config", str(date_run), *sum((["--set", s] for s in DATE_SPLIT), [])]
    assert run_main(forecast.main, argv) == 0
    table = forecast_table(date_run)
    # 48 test bars per series from 2024-01-08, windows of predict 4 bars, non-overlapping: 12 per series
    assert table.groupby("window")["timestamps"].min().min() == pd.Timestamp("2024-01-08 09:30")
    assert table["window"].nunique() == 2 * 12
    metrics = json.loads((date_run.parent / "out/tiny/forecast/metrics.json").read_text())
    assert metrics["windows_dropped_seen_in_training"] == 0


def test_a_split_moved_into_the_training_data_scores_only_the_unseen_windows(date_run, caplog):
    # ratios 0.5 / 0.15 / 0.35 of all candles: the test starts at row 156 of each series (2024-01-05 10:30),
    # inside the run's validation (to 2024-01-08): first targets at rows 156, 160, ..., 188 were seen (9 a series)
    cfg = load(date_run, ["data.train_ratio=0.5", "data.val_ratio=0.15", "data.test_ratio=0.35",
                          "data.train_end=null", "data.val_end=null", "forecast.max_windows=null",
                          "forecast.sample_count=4"])
    metrics = forecast.run_forecast(cfg)
    assert metrics["windows_dropped_seen_in_training"] == 2 * 9 and metrics["windows"] == 2 * 12
    assert "overlap what the run trained or validated on" in caplog.text
    folder = next(p for p in (date_run.parent / "out/tiny").iterdir() if p.name.startswith("forecast_"))
    assert forecast_table(date_run, folder.name)["timestamps"].min() == pd.Timestamp("2024-01-08 09:30")


def test_a_forecast_folder_made_with_other_settings_is_refused_not_replaced(date_run, capsys):
    argv = ["--config", str(date_run), *sum((["--set", s] for s in DATE_SPLIT), [])]
    assert run_main(forecast.main, argv) == 0
    before = (date_run.parent / "out/tiny/forecast/forecast.csv").read_bytes()
    # a setting the calibration does not depend on (other sampling is refused by the calibration itself)
    assert run_main(forecast.main, [*argv, "--set", "forecast.max_windows=5"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "forecast.max_windows" in err and "remove it to replace it" in err and "Traceback" not in err
    assert (date_run.parent / "out/tiny/forecast/forecast.csv").read_bytes() == before


def test_a_planted_split_and_gap_are_warned_with_the_series_and_dates(tmp_path, caplog):
    from finetune_csv.prepare import prepare_store

    frame = generate_ohlcv(n_series=1, n_bars=300, freq="1D", seed=1)["SH600000"]
    frame = frame[frame["timestamps"].dt.day_of_week < 5].reset_index(drop=True)
    split_at = 100  # a 4:1 split not adjusted: every price from here on a quarter
    frame.loc[split_at:, ["open", "high", "low", "close"]] /= 4
    frame.loc[150:, "timestamps"] += pd.Timedelta(days=3 * 365)  # three years without bars
    frame.to_csv(tmp_path / "AAPL.csv", index=False)
    with caplog.at_level("WARNING"):
        prepare_store(tmp_path / "AAPL.csv", tmp_path / "store")
    text = caplog.text
    assert "AAPL" in text and f"split-like ratio at {frame['timestamps'][split_at].date()}" in text
    assert f"1 gap(s) of many bar spacings, the bar after each at {frame['timestamps'][150].date()}" in text


def test_an_ordinary_daily_series_gets_no_split_or_gap_warning():
    from finetune_csv.prepare import jump_notes

    frame = generate_ohlcv(n_series=1, n_bars=300, freq="1D", seed=1)["SH600000"]
    values = frame[["open", "high", "low", "close", "volume", "amount"]].to_numpy()
    assert jump_notes(frame["timestamps"].to_numpy().view("int64"), values, "AAPL") == []


def test_max_gap_days_drops_the_bars_before_the_last_long_gap(tmp_path):
    from finetune_csv.prepare import StoreSettings, prepare_store

    frame = generate_ohlcv(n_series=1, n_bars=300, freq="1D", seed=1)["SH600000"]
    frame.loc[150:, "timestamps"] += pd.Timedelta(days=3 * 365)
    frame.to_csv(tmp_path / "FB.csv", index=False)
    info = prepare_store(tmp_path / "FB.csv", tmp_path / "store", StoreSettings(max_gap_days=30))
    assert info.manifest["series"][0]["rows"] == 150
    assert info.manifest["series"][0]["start"] == str(frame["timestamps"][150])


def test_an_adjustment_factor_column_removes_the_split_warning_and_joins_the_prices(tmp_path, caplog):
    from finetune.utils.store import open_store
    from finetune_csv.prepare import StoreSettings, prepare_store

    frame = generate_ohlcv(n_series=1, n_bars=200, freq="1D", seed=1)["SH600000"]
    adjusted = frame.copy()
    prices = ["open", "high", "low", "close"]
    frame.loc[:99, prices] *= 4  # unadjusted: a 4:1 split at row 100 (AAPL 2020-08-31), 4x the price before it
    frame.loc[:99, "volume"] /= 4
    frame["factor"] = np.where(np.arange(len(frame)) < 100, 0.25, 1.0)  # cumulative back-adjustment (Qlib's $factor)
    frame.to_csv(tmp_path / "AAPL.csv", index=False)
    with caplog.at_level("WARNING"):
        prepare_store(tmp_path / "AAPL.csv", tmp_path / "raw", StoreSettings(columns={"amount": None}))
    assert f"split-like ratio at {frame['timestamps'][100].date()}" in caplog.text
    assert "data.columns.factor" in caplog.text  # the warning names the setting that fixes it
    caplog.clear()
    with caplog.at_level("WARNING"):
        prepare_store(tmp_path / "AAPL.csv", tmp_path / "adj", StoreSettings(columns={"amount": None,
                                                                                      "factor": "factor"}))
    assert "split-like" not in caplog.text
    stored = np.asarray(open_store(tmp_path / "adj").features)  # (6, N) open..amount
    np.testing.assert_allclose(stored[:4].T, adjusted[prices].to_numpy(), rtol=1e-6)  # continuous again
    np.testing.assert_allclose(stored[4], adjusted["volume"].to_numpy(), rtol=1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, "", "x"])
def test_an_adjustment_factor_that_is_not_finite_and_positive_is_named(tmp_path, bad):
    from finetune_csv.prepare import StoreSettings, prepare_store
    from model.errors import DataError

    frame = generate_ohlcv(n_series=1, n_bars=40, freq="1D", seed=1)["SH600000"]
    frame["factor"] = 1.0
    frame["factor"] = frame["factor"].astype(object)
    frame.loc[7, "factor"] = bad
    frame.to_csv(tmp_path / "AAPL.csv", index=False)
    with pytest.raises(DataError, match=r"column 'factor' \(data.columns.factor\) has 1 .* line\(s\) 9\b"):
        prepare_store(tmp_path / "AAPL.csv", tmp_path / "s", StoreSettings(columns={"factor": "factor"}))


def test_a_splits_file_adjusts_a_split_and_a_reverse_split_and_its_edits_reprepare(tmp_path, caplog):
    from finetune.utils.store import open_store
    from finetune_csv.prepare import StoreSettings, ensure_store

    data, clean = tmp_path / "data", {}
    data.mkdir()
    for name, ratio, seed in (("AAPL", 4.0, 1), ("USO", 1 / 8, 2)):  # a 4:1 split and a 1:8 reverse split at row 100
        frame = generate_ohlcv(n_series=1, n_bars=200, freq="1D", seed=seed)["SH600000"].drop(columns="amount")
        clean[name] = frame.copy()
        frame.loc[:99, ["open", "high", "low", "close"]] *= ratio
        frame.loc[:99, "volume"] /= ratio
        frame.to_csv(data / f"{name}.csv", index=False)
    ex_date = {n: f["timestamps"][100].date() for n, f in clean.items()}
    with caplog.at_level("WARNING"):
        ensure_store(data, tmp_path / "raw")
    for name in clean:
        assert f"{name}.csv: the close jumps by a split-like ratio at {ex_date[name]}" in caplog.text
    assert "data.splits_path" in caplog.text
    splits = tmp_path / "splits.csv"
    splits.write_text(f"symbol,date,ratio\nAAPL,{ex_date['AAPL']},4:1\nUSO,{ex_date['USO']},1:8\nMSFT,2003-02-18,2\n")
    caplog.clear()
    with caplog.at_level("WARNING"):
        info = ensure_store(data, tmp_path / "adj", StoreSettings(splits_path=str(splits)))
    assert "split-like" not in caplog.text
    panel = open_store(info.path)
    for s, name in enumerate(panel.names):  # continuous again: the split-free prices and volumes
        stored = np.asarray(panel.features)[:, panel.offsets[s]:panel.offsets[s + 1]]  # (6, n)
        np.testing.assert_allclose(stored[:5].T, clean[name.removesuffix(".csv")][["open", "high", "low", "close",
                                                                                   "volume"]].to_numpy(), rtol=1e-6)
    splits.write_text(f"symbol,date,ratio\nAAPL,{ex_date['AAPL']},4\n")  # edited: the store is prepared again
    assert not ensure_store(data, tmp_path / "adj", StoreSettings(splits_path=str(splits))).reused


@pytest.mark.parametrize("row", ["AAPL,2020-08-31,0", "AAPL,2020-08-31,-4", "AAPL,2020-08-31,inf", "AAPL,someday,4",
                                 "AAPL,2020-08-31,4:0", ",2020-08-31,4"])
def test_a_bad_row_of_the_splits_file_is_one_line_naming_the_setting(tmp_path, row):
    from finetune.utils.errors import StoreError
    from finetune_csv.prepare import StoreSettings, prepare_store

    generate_ohlcv(n_series=1, n_bars=40, freq="1D", seed=1)["SH600000"].to_csv(tmp_path / "AAPL.csv", index=False)
    (tmp_path / "splits.csv").write_text(f"symbol,date,ratio\nUSO,2020-04-29,1:8\n{row}\n")
    with pytest.raises(StoreError, match=r"^data.splits_path: .*splits.csv line 3: .* ratio > 0") as e:
        prepare_store(tmp_path / "AAPL.csv", tmp_path / "s", StoreSettings(splits_path=str(tmp_path / "splits.csv")))
    assert "\n" not in str(e.value) and not (tmp_path / "s").exists()


def test_the_adjustment_settings_are_checked_when_the_config_is_read(tmp_path):
    from model.errors import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text(TINY_YAML.format(data=tmp_path, out=tmp_path / "out"))
    with pytest.raises(ConfigError, match="data.splits_path: 'nowhere.csv' is not a file"):
        load(config, ["data.splits_path=nowhere.csv"])
    with pytest.raises(ConfigError, match=r"data.columns: maps one CSV column to several fields"):
        load(config, ["data.columns.factor=close"])
    assert load(config, ["data.columns.factor=Factor", "data.header=none"]).data.columns.factor == "Factor"
    (tmp_path / "s.csv").write_text("symbol,date,ratio\nAAPL,2020-08-31,4\n")
    with pytest.raises(ConfigError, match=r"data.columns.factor and data.splits_path both adjust the prices"):
        load(config, ["data.columns.factor=Factor", f"data.splits_path={tmp_path / 's.csv'}"])
    with pytest.raises(ConfigError, match=r"data.splits_path and data.adjust: adj_close both adjust the prices"):
        load(config, [f"data.splits_path={tmp_path / 's.csv'}", "data.adjust=adj_close"])
