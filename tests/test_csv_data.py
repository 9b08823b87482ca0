"""CSV loading rules (on the pandas reference, tests/csv_reference.py), the split rules (finetune_csv.splits), and the
prepared store (finetune_csv.prepare) compared with the reference bit for bit."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pandas as pd
import pytest

from finetune_csv.config import ColumnsConfig, DataConfig
from finetune_csv.prepare import data_summary_from_store, prepare_data
from finetune_csv.splits import build_dataset, min_rows_needed, split_bounds, split_is_usable
from tests.csv_reference import candles, data_summary, load_series, reference_dataset, split_series, window_starts


def data_cfg(path, **kw) -> DataConfig:
    base = dict(path=str(path), lookback=8, predict=4, train_ratio=0.6, val_ratio=0.2, test_ratio=0.2,
                split="per_series")  # the reference cuts each series by its own rows
    base.update(kw)
    return DataConfig(**base)


def write(frame: pd.DataFrame, path) -> str:
    frame.to_csv(path, index=False)
    return str(path)


# --------------------------------------------------------------------------------------------- loading


def test_single_file_loads_values_in_feature_order(tmp_path):
    frame = candles(60)
    (s,) = load_series(data_cfg(write(frame, tmp_path / "a.csv")))
    assert s.name == "a.csv"
    assert s.values.shape == (60, 6)
    np.testing.assert_allclose(s.values[:, 3], frame["close"].to_numpy())
    np.testing.assert_allclose(s.values[:, 5], frame["amount"].to_numpy())
    assert (s.timestamps == pd.DatetimeIndex(frame["timestamps"])).all()


def test_folder_gives_one_series_per_csv_and_ignores_other_files(tmp_path):
    write(candles(40, seed=1), tmp_path / "b.csv")
    write(candles(50, seed=2), tmp_path / "a.csv")
    (tmp_path / "README.txt").write_text("not data")
    series = load_series(data_cfg(tmp_path))
    assert [s.name for s in series] == ["a.csv", "b.csv"]
    assert [len(s.values) for s in series] == [50, 40]


def test_symbol_column_splits_one_file_into_series(tmp_path):
    both = pd.concat([candles(30, seed=1, ticker="AAA"), candles(45, seed=2, ticker="BBB")])
    series = load_series(data_cfg(write(both, tmp_path / "m.csv"), symbol_column="ticker"))
    assert [(s.name, len(s.values)) for s in series] == [("m.csv[AAA]", 30), ("m.csv[BBB]", 45)]


def test_column_mapping_renames_user_columns(tmp_path):
    frame = candles(30).rename(columns={"timestamps": "Date", "close": "Close", "volume": "Vol", "amount": "Turnover"})
    cols = ColumnsConfig(timestamps="Date", close="Close", volume="Vol", amount="Turnover")
    (s,) = load_series(data_cfg(write(frame, tmp_path / "a.csv"), columns=cols))
    np.testing.assert_allclose(s.values[:, 3], frame["Close"].to_numpy())


def test_missing_volume_gives_zero_volume_and_amount(tmp_path):
    frame = candles(30).drop(columns=["volume", "amount"])
    (s,) = load_series(data_cfg(write(frame, tmp_path / "a.csv")))
    assert (s.values[:, 4:] == 0).all()


def test_missing_amount_is_volume_times_mean_price(tmp_path):
    frame = candles(30).drop(columns=["amount"])
    (s,) = load_series(data_cfg(write(frame, tmp_path / "a.csv")))
    expected = frame["volume"] * frame[["open", "high", "low", "close"]].mean(axis=1)
    np.testing.assert_allclose(s.values[:, 5], expected.to_numpy())


def test_unsorted_timestamps_are_sorted_with_a_warning(tmp_path, caplog):
    frame = candles(30)
    shuffled = frame.sample(frac=1.0, random_state=0)
    with caplog.at_level(logging.WARNING):
        (s,) = load_series(data_cfg(write(shuffled, tmp_path / "a.csv")))
    assert "not sorted" in caplog.text and "a.csv" in caplog.text
    np.testing.assert_allclose(s.values[:, 3], frame["close"].to_numpy())  # rows kept their values
    assert s.timestamps.is_monotonic_increasing


# --------------------------------------------------------------------------------------------- bad input


def error_of(cfg: DataConfig) -> str:
    with pytest.raises(ValueError) as info:
        load_series(cfg)
    return str(info.value)


def test_missing_path_names_the_setting(tmp_path):
    msg = error_of(data_cfg(tmp_path / "nope.csv"))
    assert "data.path" in msg and "nope.csv" in msg and "does not exist" in msg


def test_folder_without_csv_is_an_error(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    assert "no .csv file" in error_of(data_cfg(tmp_path))


def test_empty_file_and_header_only_file(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    assert "empty.csv: the file is empty" in error_of(data_cfg(tmp_path / "empty.csv"))
    (tmp_path / "head.csv").write_text("timestamps,open,high,low,close\n")
    assert "head.csv: the file has a header but no rows" in error_of(data_cfg(tmp_path / "head.csv"))


def test_misspelled_column_suggests_the_close_match(tmp_path):
    frame = candles(30).rename(columns={"close": "clsoe"})
    msg = error_of(data_cfg(write(frame, tmp_path / "a.csv")))
    assert "column 'close' (data.columns.close) not found" in msg
    assert "did you mean 'clsoe'" in msg


def test_misspelled_optional_volume_is_an_error_not_zeros(tmp_path):
    frame = candles(30).rename(columns={"volume": "Volume"})
    msg = error_of(data_cfg(write(frame, tmp_path / "a.csv")))
    assert "data.columns.volume" in msg and "did you mean 'Volume'" in msg


def test_missing_required_column_without_close_match(tmp_path):
    frame = candles(30).drop(columns=["low"])
    msg = error_of(data_cfg(write(frame, tmp_path / "a.csv")))
    assert "column 'low' (data.columns.low) not found" in msg and "the header is" in msg


def test_non_numeric_value_names_column_line_and_value(tmp_path):
    frame = candles(30).astype({"open": object})
    frame.loc[4, "open"] = "12,5"
    msg = error_of(data_cfg(write(frame, tmp_path / "a.csv")))
    assert "column 'open' (data.columns.open) has non-numeric value(s) at line(s) 6: '12,5'" in msg


def test_unparseable_timestamp_names_line_and_format_setting(tmp_path):
    frame = candles(30).astype({"timestamps": object})
    frame.loc[2, "timestamps"] = "yesterday"
    msg = error_of(data_cfg(write(frame, tmp_path / "a.csv")))
    assert "unparseable timestamp(s) at line(s) 4" in msg and "'yesterday'" in msg and "data.timestamp_format" in msg


def test_all_problems_of_all_files_are_reported_at_once(tmp_path):
    bad_num = candles(30).astype({"high": object})
    bad_num.loc[0, "high"] = "x"
    write(bad_num, tmp_path / "a.csv")
    write(candles(30).rename(columns={"close": "Close"}), tmp_path / "b.csv")
    msg = error_of(data_cfg(tmp_path))
    assert "(2 problems):" in msg and "a.csv" in msg and "b.csv" in msg


def test_duplicate_timestamps_are_an_error(tmp_path):
    frame = candles(30)
    frame.loc[10, "timestamps"] = frame.loc[9, "timestamps"]
    msg = error_of(data_cfg(write(frame, tmp_path / "a.csv")))
    assert "1 duplicate timestamp(s)" in msg and "line(s) 11, 12" in msg


def test_nan_policy_error_names_column_and_line(tmp_path):
    frame = candles(30)
    frame.loc[3, "close"] = np.nan
    msg = error_of(data_cfg(write(frame, tmp_path / "a.csv")))
    assert "missing values in column 'close' at line(s) 5" in msg and "data.nan_policy" in msg


def test_nan_policy_ffill_carries_the_last_value(tmp_path, caplog):
    frame = candles(30)
    frame.loc[3, "close"] = np.nan
    with caplog.at_level(logging.WARNING):
        (s,) = load_series(data_cfg(write(frame, tmp_path / "a.csv"), nan_policy="ffill"))
    assert s.values[3, 3] == pytest.approx(frame.loc[2, "close"])
    assert "forward-filling 1 missing value" in caplog.text


def test_nan_policy_ffill_cannot_fill_the_first_row(tmp_path):
    frame = candles(30)
    frame.loc[0, "open"] = np.nan
    msg = error_of(data_cfg(write(frame, tmp_path / "a.csv"), nan_policy="ffill"))
    assert "first row" in msg


def test_nan_policy_drop_removes_rows_with_a_warning(tmp_path, caplog):
    frame = candles(30)
    frame.loc[[3, 7], "volume"] = np.nan
    with caplog.at_level(logging.WARNING):
        (s,) = load_series(data_cfg(write(frame, tmp_path / "a.csv"), nan_policy="drop"))
    assert len(s.values) == 28
    assert "dropping 2 row(s)" in caplog.text


# --------------------------------------------------------------------------------------------- splitting


def test_split_bounds_follow_the_ratios():
    assert split_bounds(100, 0.7, 0.2) == (70, 90)
    assert split_bounds(10, 0.7, 0.2) == (7, 9)  # 0.7 + 0.2 = 0.8999..., still 9


def test_min_rows_needed_is_the_smallest_usable_length():
    cfg = DataConfig(lookback=8, predict=4, train_ratio=0.6, val_ratio=0.2, test_ratio=0.2)
    n = min_rows_needed(cfg)
    assert split_is_usable(n, cfg) and not split_is_usable(n - 1, cfg)


def test_val_and_test_windows_predict_only_their_own_rows(tmp_path):
    cfg = data_cfg(write(candles(100), tmp_path / "a.csv"))
    series = load_series(cfg)
    splits = split_series(series, cfg)
    train, val, test = splits["train"][0], splits["val"][0], splits["test"][0]
    assert (train.start, train.stop) == (0, 60)
    assert (val.start, val.first_target, val.stop) == (52, 60, 80)  # 8 rows of context before the split
    assert (test.start, test.first_target, test.stop) == (72, 80, 100)
    window = cfg.lookback + cfg.predict
    for seg in (val, test):
        starts = window_starts(seg, window, 1) + seg.start
        first_predicted = starts + cfg.lookback
        assert first_predicted.min() == seg.first_target  # the first window predicts the split's first row
        assert (starts + window).max() == seg.stop  # the last window ends at the split's end


def test_too_short_series_says_how_many_rows_are_needed(tmp_path):
    cfg = data_cfg(tmp_path)
    write(candles(200, seed=1), tmp_path / "long.csv")
    write(candles(15, seed=2), tmp_path / "short.csv")
    with pytest.raises(ValueError) as info:
        split_series(load_series(cfg), cfg)
    msg = str(info.value)
    assert f"at least {min_rows_needed(cfg)} rows" in msg and "short.csv: 15 rows" in msg
    assert "long.csv" not in msg


def test_empty_validation_split_is_an_error(tmp_path):
    # 40 rows: train 36 rows is plenty, but val = 40*0.05 = 2 rows < predict (4).
    cfg = data_cfg(write(candles(40), tmp_path / "a.csv"), train_ratio=0.9, val_ratio=0.05, test_ratio=0.05)
    with pytest.raises(ValueError, match=r"'val': 2"):
        split_series(load_series(cfg), cfg)


def test_windows_never_cross_series_and_use_lookback_statistics(tmp_path):
    write(candles(50, seed=1), tmp_path / "a.csv")
    write(candles(50, seed=2, start="2025-03-03 09:30"), tmp_path / "b.csv")
    cfg = data_cfg(tmp_path, stride=2)
    series = load_series(cfg)
    splits = split_series(series, cfg)
    ds = reference_dataset(splits["train"], cfg)
    train_rows = split_bounds(50, cfg.train_ratio, cfg.val_ratio)[0]
    per_series = len(range(0, train_rows - 12 + 1, 2))
    assert len(ds) == 2 * per_series
    x, stamp = ds[per_series]  # the first window of the second series
    raw = series[1].values[0:12]
    mean, std = raw[:8].mean(0), raw[:8].std(0)
    np.testing.assert_allclose(x.numpy(), np.clip((raw - mean) / (std + 1e-5), -5, 5), rtol=1e-4, atol=1e-4)
    ts = series[1].timestamps[0]
    assert stamp[0].tolist() == [ts.minute, ts.hour, ts.weekday(), ts.day, ts.month]


def test_data_summary_records_files_hashes_and_split_ranges(tmp_path):
    cfg = data_cfg(write(candles(100), tmp_path / "a.csv"))
    series = load_series(cfg)
    summary = data_summary(series, split_series(series, cfg), cfg)
    assert summary["files"][0]["sha256"] == hashlib.sha256((tmp_path / "a.csv").read_bytes()).hexdigest()
    assert summary["splits"]["train"]["rows"] == 60 and summary["splits"]["val"]["context_rows"] == 8
    assert summary["splits"]["test"]["end"] == str(series[0].timestamps[-1])
    assert summary["splits"]["val"]["windows"] == 20 - 4 + 1


# --------------------------------------------------------------------------------------------- production path
# The training pipeline reads the prepared, memory-mapped store (finetune_csv.prepare.prepare_data); the tests above
# exercise the pandas reference implementation of the same rules.


def prepare(cfg: DataConfig, tmp_path, name: str = "store"):
    return prepare_data(cfg, tmp_path / name)


def test_prepared_windows_equal_the_reference_windows_and_are_mapped(tmp_path):
    folder = tmp_path / "csv"
    folder.mkdir()
    for i in range(3):
        write(candles(90 + 11 * i, seed=i), folder / f"s{i}.csv")
    cfg = data_cfg(folder, stride=3)
    data = prepare(cfg, tmp_path)
    ref = split_series(load_series(cfg), cfg)
    for name in ("train", "val", "test"):
        ours, theirs = build_dataset(data.splits[name], cfg), reference_dataset(ref[name], cfg)
        assert isinstance(ours.features_t, np.memmap) and len(ours) == len(theirs)
        idx = np.arange(len(ours))
        x, st = ours.get_batch(idx)
        x_ref, st_ref = theirs.get_batch(idx)
        assert np.array_equal(x.numpy(), x_ref.numpy()) and np.array_equal(st.numpy(), st_ref.numpy())
    summary, ref_summary = data_summary_from_store(data, cfg), data_summary(load_series(cfg), ref, cfg)
    assert summary["splits"] == ref_summary["splits"] and summary["series"] == ref_summary["series"]
    assert [f["sha256"] for f in summary["files"]] == [f["sha256"] for f in ref_summary["files"]]
    assert not data.store.reused
    again = prepare(cfg, tmp_path)
    # A reused store describes the same data the same way (a resume compares these summaries' fingerprints).
    assert again.store.reused and data_summary_from_store(again, cfg) == summary


def test_dst_offsets_keep_the_exchange_wall_clock_and_data_timezone_converts(tmp_path):
    # New York: -05:00 before 2024-03-10, -04:00 after; every bar is 09:30 local time.
    days = pd.bdate_range("2024-03-04", "2024-03-15")
    stamps = [f"{d:%Y-%m-%d} 09:30:00{'-05:00' if d < pd.Timestamp('2024-03-10') else '-04:00'}" for d in days]
    frame = candles(len(days)).assign(timestamps=stamps)
    path = write(frame, tmp_path / "ny.csv")
    cfg = data_cfg(path, lookback=2, predict=1)
    panel = prepare(cfg, tmp_path).panel
    assert set(panel.stamps[:, 1].tolist()) == {9} and set(panel.stamps[:, 0].tolist()) == {30}
    shanghai = prepare(data_cfg(path, lookback=2, predict=1, timezone="Asia/Shanghai"), tmp_path, "sh").panel
    assert shanghai.stamps[0, 1] == 22 and shanghai.stamps[-1, 1] == 21  # 14:30 / 13:30 UTC + 8h
    # the pandas reference follows the same rule
    (s,) = load_series(cfg)
    assert (s.timestamps.hour == 9).all() and s.timestamps.tz is None


def test_tz_aware_and_naive_files_mixed_is_an_error_naming_both(tmp_path):
    folder = tmp_path / "csv"
    folder.mkdir()
    write(candles(60), folder / "naive.csv")
    aware = candles(60)
    aware["timestamps"] = aware["timestamps"].dt.strftime("%Y-%m-%d %H:%M:%S+08:00")
    write(aware, folder / "aware.csv")
    with pytest.raises(ValueError, match=r"UTC offset \(aware.csv\).*without \(naive.csv\)"):
        prepare(data_cfg(folder), tmp_path)
    assert not (tmp_path / "store").exists()


def test_a_file_of_another_bar_length_is_named_in_a_warning_or_an_error(tmp_path, caplog):
    folder = tmp_path / "csv"
    folder.mkdir()
    write(candles(60), folder / "a_5min.csv")
    write(candles(60), folder / "b_5min.csv")
    daily = candles(60)
    daily["timestamps"] = pd.date_range("2024-01-02", periods=60, freq="D")
    write(daily, folder / "c_daily.csv")
    with caplog.at_level(logging.WARNING):
        data = prepare(data_cfg(folder), tmp_path)
    assert any("1 day: c_daily.csv" in w for w in data.store.manifest["warnings"])
    assert "c_daily.csv" in caplog.text
    with pytest.raises(ValueError, match=r"data.frequency is 5min but 1 file\(s\).*c_daily.csv \(1 day\)"):
        prepare(data_cfg(folder, frequency="5min"), tmp_path, "strict")


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
@pytest.mark.parametrize("column, value", [("volume", 1e39), ("close", 1e-46)])  # inf / 0 after the cast
def test_values_float32_does_not_keep_name_file_column_and_line(tmp_path, suffix, column, value):
    frame = candles(60)
    frame.loc[7, column] = value
    path = tmp_path / f"a{suffix}"
    frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path, index=False)
    where = "line 9" if suffix == ".csv" else "row 8"
    with pytest.raises(ValueError, match=rf"a{suffix} {where}, column '{column}': value {value:.6g} is a value "
                                         "float32 cannot hold".replace("+", "\\+")) as err:
        prepare(data_cfg(path), tmp_path)
    assert err.value.exit_code == 3  # the CLI's exit code for bad data
    if suffix == ".csv":
        with pytest.raises(ValueError, match=rf"a.csv line 9, column '{column}'"):
            load_series(data_cfg(path))


def test_unnamed_first_column_of_dates_is_taken_as_timestamps(tmp_path, caplog):
    frame = candles(60).set_index("timestamps")
    frame.index.name = None
    frame.to_csv(tmp_path / "indexed.csv")  # header: ",open,high,..."
    with caplog.at_level(logging.INFO):
        data = prepare(data_cfg(tmp_path / "indexed.csv"), tmp_path)
    assert "taking the unnamed first column" in caplog.text
    assert data.panel.stamps[0, 1] == 9 and data.panel.stamps[0, 0] == 30
    # an unnamed first column that is not dates: the error suggests what to do
    candles(60).drop(columns="timestamps").to_csv(tmp_path / "numbered.csv")
    with pytest.raises(ValueError, match=r"first column has no header \(read as 'Unnamed: 0'\)"):
        prepare(data_cfg(tmp_path / "numbered.csv"), tmp_path, "numbered")


def test_parquet_folder_is_read_through_the_store(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    for i in range(2):
        candles(80, seed=i).to_parquet(folder / f"s{i}.parquet", index=False)
        write(candles(80, seed=i), tmp_path / f"s{i}.csv")
    data = prepare(data_cfg(folder), tmp_path)
    ref = split_series(load_series(data_cfg(tmp_path)), data_cfg(tmp_path))
    assert data.panel.names == ["s0.parquet", "s1.parquet"]
    x, _ = build_dataset(data.splits["train"], data_cfg(folder)).get_batch([0, 5])
    assert np.array_equal(x.numpy(), reference_dataset(ref["train"], data_cfg(tmp_path)).get_batch([0, 5])[0].numpy())


def test_bad_timezone_and_frequency_settings_name_their_keys():
    from finetune_csv.config import CsvFinetuneConfig, validate

    cfg = CsvFinetuneConfig(data=DataConfig(path="x.csv", timezone="Mars/Olympus", frequency="often"))
    with pytest.raises(ValueError) as info:
        validate(cfg)
    assert "data.timezone" in str(info.value) and "data.frequency" in str(info.value)


def test_a_failed_preparation_leaves_no_folder_behind(tmp_path):
    path = write(candles(10), tmp_path / "short.csv")
    with pytest.raises(ValueError, match=r"needs at least \d+ rows"):
        prepare_data(data_cfg(path), tmp_path / "out" / "exp" / "data_store")
    assert not (tmp_path / "out").exists()
