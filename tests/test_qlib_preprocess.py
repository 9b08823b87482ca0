"""finetune/qlib_data_preprocess.py: the panel, the split rules (no overlap beyond the lookback margin), the files."""

import json

import numpy as np
import pandas as pd
import pytest

from finetune import qlib_data_preprocess as pre
from finetune import qlib_io as qio
from finetune.config import QlibConfig
from finetune.dataset import MANIFEST_NAME, content_sha256, load_split, split_path
from finetune.utils.config_utils import load_config
from model.errors import ConfigError

LOOKBACK, PREDICT = 6, 2


def stacked_frame(spec: dict[str, tuple[str, int]], seed: int = 0) -> pd.DataFrame:
    """Qlib-like frame (index instrument, datetime; $open ... $vwap) with `spec` = {name: (first day, bars)}."""
    rng = np.random.default_rng(seed)
    parts = []
    for name, (first, bars) in spec.items():
        days = pd.bdate_range(first, periods=bars)
        close = 10 * np.exp(np.cumsum(rng.normal(0, 0.02, bars)))
        df = pd.DataFrame({
            "$open": close * 1.001, "$high": close * 1.01, "$low": close * 0.99, "$close": close,
            "$volume": rng.uniform(1e5, 2e5, bars), "$vwap": close * 1.002,
        }, index=pd.MultiIndex.from_product([[name], days], names=["instrument", "datetime"]))
        parts.append(df)
    return pd.concat(parts[::-1])  # unsorted on purpose: the panel must sort


def cfg_for(tmp_path, **data):
    sets = [f"data.{k}={v}" for k, v in {
        "qlib_data_path": tmp_path / "qlib", "dataset_path": tmp_path / "processed",
        "lookback": LOOKBACK, "predict": PREDICT,
        "dataset_begin_time": "2020-01-01", "dataset_end_time": "2020-12-31",
        "train_time_range": "[2020-01-01, 2020-03-31]", "val_time_range": "[2020-04-01, 2020-05-31]",
        "test_time_range": "[2020-06-01, 2020-06-30]", **data}.items()]
    return load_config(QlibConfig, None, sets)  # settings only: the folder checks are what these tests exercise


def dates(split, s):
    return pd.DatetimeIndex(split.datetimes[split.rows(s)].astype("datetime64[ns]"))


def test_panel_derives_vol_and_amount_and_is_contiguous():
    frame = stacked_frame({"B": ("2020-01-01", 30), "A": ("2020-01-01", 25)})
    panel, report = qio.frame_to_panel(frame, "ohlc_mean", min_bars=8)
    assert list(panel.names) == ["A", "B"] and list(panel.offsets) == [0, 25, 55]
    a = frame.loc["A"]
    np.testing.assert_allclose(panel.features[4, :25], a["$volume"], rtol=1e-6)
    ohlc_mean = a[["$open", "$high", "$low", "$close"]].mean(axis=1)
    np.testing.assert_allclose(panel.features[5, :25], a["$volume"] * ohlc_mean, rtol=1e-5)
    assert panel.features.dtype == np.float32 and panel.stamps.dtype == np.int64
    assert (np.diff(panel.datetimes[:25]) > 0).all()
    # stamps: minute, hour, weekday, day, month of each bar
    first = pd.Timestamp(int(panel.datetimes[0]))
    assert list(panel.stamps[0]) == [0, 0, first.weekday(), first.day, first.month]
    vwap_panel, _ = qio.frame_to_panel(frame, "vwap", min_bars=8)
    np.testing.assert_allclose(vwap_panel.features[5, :25], a["$volume"] * a["$vwap"], rtol=1e-5)
    assert report.nan_rows == {} and report.short == {}


def test_panel_drops_missing_rows_and_short_instruments_and_reports_them():
    frame = stacked_frame({"A": ("2020-01-01", 30), "B": ("2020-01-01", 5), "C": ("2020-01-01", 20)})
    frame.loc[("A", frame.loc["A"].index[3]), "$close"] = np.nan
    frame.loc[("C", frame.loc["C"].index[0]), "$volume"] = np.inf
    panel, report = qio.frame_to_panel(frame, "ohlc_mean", min_bars=8)
    assert report.nan_rows == {"A": 1, "C": 1}
    assert report.short == {"B": 5}
    assert list(panel.names) == ["A", "C"] and list(np.diff(panel.offsets)) == [29, 19]
    assert np.isfinite(panel.features).all()


def test_load_range_adds_lookback_and_predict_margins():
    cal = pd.bdate_range("2020-01-01", periods=100)
    start, end = qio.load_range(cal, str(cal[10].date()), str(cal[50].date()), lookback=4, predict=3)
    assert (start, end) == (cal[6], cal[53])
    start, end = qio.load_range(cal, "2019-01-01", "2030-01-01", lookback=4, predict=3)  # clamped
    assert (start, end) == (cal[0], cal[-1])


def test_splits_follow_the_ranges_with_only_the_lookback_margin_shared(tmp_path):
    cfg = cfg_for(tmp_path)
    # "late" is listed inside the validation range: it gets no lookback margin there, and no training bars.
    frame = stacked_frame({"A": ("2020-01-01", 160), "B": ("2020-01-01", 160), "late": ("2020-04-20", 60)})
    panel, _ = qio.frame_to_panel(frame, "ohlc_mean", min_bars=LOOKBACK)
    splits, report = pre.make_splits(panel, cfg)
    train, val, test = splits["train"], splits["val"], splits["test"]
    assert list(train.names) == ["A", "B"] and list(val.names) == ["A", "B", "late"]

    train_end, val_start, val_end = pd.Timestamp("2020-03-31"), pd.Timestamp("2020-04-01"), pd.Timestamp("2020-05-31")
    test_start, test_end = pd.Timestamp("2020-06-01"), pd.Timestamp("2020-06-30")
    for s in range(2):
        tr, va, te = dates(train, s), dates(val, s), dates(test, s)
        assert tr.min() >= pd.Timestamp("2020-01-01") and tr.max() <= train_end
        # exactly LOOKBACK bars before the validation range, all of them training-period bars ...
        assert (va < val_start).sum() == LOOKBACK and va.max() <= val_end
        # ... so every target bar of a validation window (bar >= LOOKBACK of the window) lies inside the range
        assert va[LOOKBACK] >= val_start
        # a test forecast at t needs lookback bars ending at t: LOOKBACK - 1 bars of context before the range
        assert (te < test_start).sum() == LOOKBACK - 1
        # nothing after the range: labels come from Qlib expressions, not from the split
        assert (te > test_end).sum() == 0
        # the lookback margin is the only overlap between consecutive splits
        assert len(tr.intersection(va)) == LOOKBACK and len(va.intersection(te)) == LOOKBACK - 1
        assert len(tr.intersection(te)) == 0
    assert (dates(val, 2) >= pd.Timestamp("2020-04-20")).all()
    assert report["val"]["context_bars"] == LOOKBACK and report["test"]["context_bars"] == LOOKBACK - 1


def test_too_short_instruments_are_dropped_per_split_by_name(tmp_path, caplog):
    cfg = cfg_for(tmp_path)
    # "brief" has 5 bars in the training range: fewer than one window of LOOKBACK + PREDICT.
    frame = stacked_frame({"A": ("2020-01-01", 160), "brief": ("2020-03-25", 5)})
    panel, _ = qio.frame_to_panel(frame, "ohlc_mean", min_bars=1)
    with caplog.at_level("WARNING", logger="finetune.qlib"):
        splits, report = pre.make_splits(panel, cfg)
    assert list(splits["train"].names) == ["A"]
    assert report["train"]["dropped_too_short"] == {"brief": 5}
    assert "brief" in caplog.text and "train" in caplog.text


def test_a_range_that_leaves_a_split_empty_names_the_setting(tmp_path):
    cfg = cfg_for(tmp_path, lookback=40)
    frame = stacked_frame({"A": ("2020-01-01", 66)})  # ends 2020-04-01: too short for validation, none for the test
    panel, _ = qio.frame_to_panel(frame, "ohlc_mean", min_bars=1)
    with pytest.raises(ConfigError) as err:
        pre.make_splits(panel, cfg)
    assert "data.val_time_range" in str(err.value) and "data.test_time_range" in str(err.value)
    assert "data.train_time_range" not in str(err.value)


def test_written_splits_load_without_pickle_and_round_trip(tmp_path):
    cfg = cfg_for(tmp_path)
    panel, _ = qio.frame_to_panel(stacked_frame({"A": ("2020-01-01", 160), "B": ("2020-01-01", 160)}), "ohlc_mean", 1)
    splits, _ = pre.make_splits(panel, cfg)
    folder = pre.write_splits(tmp_path / "processed", splits, {"format": "x"})
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST_NAME, "test", "train", "val"]
    back = load_split(split_path(folder, "val"))
    assert isinstance(back.features, np.memmap)  # opened memory-mapped (finetune/utils/data_store.open_store)
    for name in ("features", "stamps", "datetimes", "offsets"):
        np.testing.assert_array_equal(getattr(back, name), getattr(splits["val"], name))
    assert list(back.names) == ["A", "B"]
    written = json.loads((folder / MANIFEST_NAME).read_text())
    assert written == {"format": "x", "content_sha256": content_sha256(folder)} and len(written["content_sha256"]) == 64


def test_a_failed_write_leaves_no_partial_output(tmp_path, monkeypatch):
    cfg = cfg_for(tmp_path)
    panel, _ = qio.frame_to_panel(stacked_frame({"A": ("2020-01-01", 160)}), "ohlc_mean", 1)
    splits, _ = pre.make_splits(panel, cfg)
    calls, real_save = [], pre.save_split

    def failing_save(path, split):  # the second file fails to write
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(path, split)

    monkeypatch.setattr(pre, "save_split", failing_save)
    with pytest.raises(OSError, match="disk full"):
        pre.write_splits(tmp_path / "processed", splits, {"format": "x"})
    assert not (tmp_path / "processed").exists() or not any((tmp_path / "processed").iterdir())
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary folder left either


@pytest.mark.parametrize(
    "change, key",
    [
        ({"qlib_data_path": "/nonexistent/qlib"}, "data.qlib_data_path"),
        ({"instrument": "csi999"}, "data.instrument"),
    ],
)
def test_bad_qlib_folder_settings_are_named(tmp_path, change, key):
    root = tmp_path / "qlib"
    (root / "calendars").mkdir(parents=True)
    (root / "calendars" / "day.txt").write_text("2020-01-02\n")
    (root / "instruments").mkdir()
    (root / "instruments" / "csi300.txt").write_text("A\t2020-01-02\t2020-01-02\n")
    (root / "features" / "sh000300").mkdir(parents=True)
    (root / "features" / "sh000300" / "close.day.bin").write_bytes(b"\0" * 8)
    cfg = cfg_for(tmp_path, **change)
    problems = cfg.problems()
    qio.check_qlib_folder(cfg, problems)
    named = {p.split(":")[0]: p for p in problems.items}
    assert key in named
    if key == "data.instrument":  # lists what the folder offers
        assert "csi300" in named[key]


def test_missing_benchmark_is_named(tmp_path):
    root = tmp_path / "qlib"
    (root / "calendars").mkdir(parents=True)
    (root / "calendars" / "day.txt").write_text("2020-01-02\n")
    (root / "instruments").mkdir()
    (root / "instruments" / "csi300.txt").write_text("A\t2020-01-02\t2020-01-02\n")
    cfg = cfg_for(tmp_path)
    problems = cfg.problems()
    qio.check_qlib_folder(cfg, problems)
    assert len(problems.items) == 1 and problems.items[0].startswith("backtest.benchmark")
    assert "SH000300" in problems.items[0]


def test_ranges_outside_the_calendar_are_named(tmp_path):
    cfg = cfg_for(tmp_path)
    calendar = pd.bdate_range("2020-01-01", "2020-04-30")  # no trading day in June: the test range is empty
    problems = cfg.problems()
    qio.check_ranges_in_calendar(cfg, calendar, problems)
    assert [p.split(":")[0] for p in problems.items] == ["data.test_time_range"]


def test_instruments_that_never_trade_together_are_noted(tmp_path, caplog):
    cfg = cfg_for(tmp_path)
    frame = stacked_frame({"A": ("2020-01-01", 80), "B": ("2020-05-26", 30)})  # A ends 2020-04-21: a 34-day hole
    panel, _ = qio.frame_to_panel(frame, "ohlc_mean", 1)
    with caplog.at_level("WARNING", logger=pre.log.name):
        splits, _ = pre.make_splits(panel, cfg)
    assert set(splits["test"].names) == {"B"}
    assert "no instrument has a bar from 2020-04-21 to 2020-05-26 (35 days)" in caplog.text
    assert "the test split never holds two instruments on one day" in caplog.text
    caplog.clear()
    together = stacked_frame({"A": ("2020-01-01", 160), "B": ("2020-01-01", 160)})
    with caplog.at_level("WARNING", logger=pre.log.name):
        pre.make_splits(qio.frame_to_panel(together, "ohlc_mean", 1)[0], cfg)
    assert "do not overlap" not in caplog.text and "never holds two" not in caplog.text
