"""The prepared store verifies what it opens (damaged arrays, edited sources), candle checks name file, column and
line, and the date split keeps every series' test period out of every other series' training and validation."""

from __future__ import annotations

import logging
import os

import numpy as np
import pandas as pd
import pytest

from finetune.utils.errors import StoreError
from finetune.utils.store import open_store
from finetune_csv.config import DataConfig
from finetune_csv.prepare import StoreSettings, ensure_store, prepare_data, prepare_store
from tests.csv_reference import candles


def two_files(folder):
    folder.mkdir()
    candles(120, seed=1).to_csv(folder / "a.csv", index=False)
    candles(100, seed=2).to_csv(folder / "b.csv", index=False)
    return folder


# --------------------------------------------------------------------------------------------- store verification


def test_same_size_damage_of_the_features_is_found_and_the_store_prepared_again(tmp_path, caplog):
    data, store = two_files(tmp_path / "csv"), tmp_path / "store"
    ensure_store(data, store)
    good = np.array(open_store(store).features)
    raw = bytearray((store / "features_t.npy").read_bytes())
    raw[-7] ^= 0xFF  # one flipped byte inside the last value: same size, same header
    (store / "features_t.npy").write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=r"features_t.npy is damaged"):
        open_store(store, verify=True)
    again = ensure_store(data, store)
    assert not again.reused and "features_t.npy is damaged" in again.reason
    assert np.array_equal(open_store(store, verify=True).features, good)
    assert "preparing it" in caplog.text


def test_shifted_offsets_are_found(tmp_path):
    data, store = two_files(tmp_path / "csv"), tmp_path / "store"
    ensure_store(data, store)
    offsets = np.load(store / "offsets.npy")
    np.save(store / "offsets.npy", offsets + np.array([0, 10, 0]))  # still a valid partition: windows would cross
    assert open_store(store).lengths().tolist() == [130, 90]  # structurally fine, so only the checksum can tell
    again = ensure_store(data, store)
    assert not again.reused and "offsets.npy is damaged" in again.reason
    assert open_store(store).lengths().tolist() == [120, 100]


def test_a_truncated_array_is_a_clean_error_and_is_prepared_again(tmp_path):
    data, store = two_files(tmp_path / "csv"), tmp_path / "store"
    ensure_store(data, store)
    path = store / "stamps.npy"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(StoreError, match=r"stamps.npy cannot be read .*delete the store folder"):
        open_store(store)
    again = ensure_store(data, store)
    assert not again.reused and "stamps.npy" in again.reason and open_store(store).n_rows == 220


def test_an_edit_keeping_size_and_mtime_is_detected(tmp_path):
    data, store = two_files(tmp_path / "csv"), tmp_path / "store"
    ensure_store(data, store)
    path = data / "a.csv"
    st = path.stat()
    text = path.read_text()
    i = text.index("\n", text.index("\n") + 1) - 1  # last character of the first data row (a digit)
    path.write_text(text[:i] + ("1" if text[i] != "1" else "2") + text[i + 1:])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    again = ensure_store(data, store)
    assert not again.reused and "a.csv changed (its content differs" in again.reason


# --------------------------------------------------------------------------------------------- candle checks


def bad(tmp_path, edit, name="a.csv", **settings):
    frame = candles(40)
    edit(frame)
    frame.to_csv(tmp_path / name, index=False)
    return lambda: prepare_store(tmp_path / name, tmp_path / "store", StoreSettings(**settings))


def test_prices_at_or_below_zero_are_named_by_column_and_line(tmp_path):
    def edit(f):
        f.loc[3, "low"] = -1.0
        f.loc[[5, 6], "close"] = 0.0
    with pytest.raises(StoreError) as err:
        bad(tmp_path, edit)()
    msg = str(err.value)
    assert "a.csv: column 'low' (data.columns.low) has 1 price(s) <= 0 at line(s) 5" in msg
    assert "column 'close' (data.columns.close) has 2 price(s) <= 0 at line(s) 7, 8" in msg
    assert not (tmp_path / "store").exists()


def test_high_below_the_body_and_low_above_it_are_errors_or_warnings(tmp_path, caplog):
    def edit(f):
        f.loc[2, "high"] = f.loc[2, ["open", "close"]].max() - 0.01
        f.loc[9, "low"] = f.loc[9, ["open", "close"]].min() + 0.01
    with pytest.raises(StoreError) as err:
        bad(tmp_path, edit)()
    assert "column 'high' (data.columns.high) is below max(open, close) in 1 candle(s) at line(s) 4" in str(err.value)
    assert "column 'low' (data.columns.low) is above min(open, close) in 1 candle(s) at line(s) 11" in str(err.value)
    assert "data.bad_candles: warn" in str(err.value)
    with caplog.at_level(logging.WARNING):
        info = bad(tmp_path, edit, bad_candles="warn")()
    assert info.manifest["n_rows"] == 40 and "is below max(open, close)" in caplog.text


def test_all_zero_volume_is_an_error_unless_allowed(tmp_path):
    def edit(f):
        f["volume"] = 0.0
    with pytest.raises(StoreError, match=r"column 'volume' \(data.columns.volume\) is zero in every row; set "
                                         r"data.allow_zero_volume: true"):
        bad(tmp_path, edit)()
    assert bad(tmp_path, edit, allow_zero_volume=True)().manifest["n_rows"] == 40


def test_a_duplicated_column_name_is_an_error_not_the_first_one_taken(tmp_path):
    frame = candles(30)
    text = frame.assign(close2=frame["close"] * 2).to_csv(index=False).replace("close2", "close")
    (tmp_path / "a.csv").write_text(text)
    with pytest.raises(StoreError, match=r"a.csv: columns \['close', 'close'\] all match 'close'"):
        prepare_store(tmp_path / "a.csv", tmp_path / "store")


def test_a_missing_column_in_a_very_wide_file_gives_a_short_message(tmp_path):
    header = ["timestamps", "open", "high", "low"] + [f"c{i}" for i in range(20000)]
    (tmp_path / "w.csv").write_text(",".join(header) + "\n" + ",".join(["2024-01-01"] + ["1"] * 20003) + "\n")
    with pytest.raises(StoreError) as err:
        prepare_store(tmp_path / "w.csv", tmp_path / "store")
    assert "no 'close' column" in str(err.value) and "19992 more" in str(err.value)
    assert len(str(err.value)) < 1000


# --------------------------------------------------------------------------------------------- splits


def uneven_overlapping(folder):
    """Four series of uneven lengths and starts that overlap in time (daily bars)."""
    folder.mkdir()
    for i, (start, n) in enumerate([("2020-01-01", 400), ("2020-06-01", 250), ("2019-03-01", 600),
                                    ("2020-03-15", 120)]):
        frame = candles(n, seed=i)
        frame["timestamps"] = pd.date_range(start, periods=n, freq="D")
        frame.to_csv(folder / f"s{i}.csv", index=False)
    return folder


def periods(data):
    """{split: [(first own date, last date) or None per series]}."""
    when = np.asarray(data.panel.datetimes)
    return {name: [(pd.Timestamp(when[a]), pd.Timestamp(when[b - 1])) if b > a else None
                   for a, b in zip(seg.first_target, seg.stop)] for name, seg in data.splits.items()}


def test_by_date_is_the_default_for_overlapping_series_and_no_test_date_lies_in_another_train_or_val(tmp_path):
    cfg = DataConfig(path=str(uneven_overlapping(tmp_path / "csv")), lookback=20, predict=5, train_ratio=0.6,
                     val_ratio=0.2, test_ratio=0.2)
    data = prepare_data(cfg, tmp_path / "store")
    assert data.split["mode"] == "by_date"
    p = periods(data)
    test_first = min(t[0] for t in p["test"] if t)
    val_first = min(t[0] for t in p["val"] if t)
    for name in ("train", "val"):
        assert max(t[1] for t in p[name] if t) < test_first  # every series' train/val ends before any test date
    assert max(t[1] for t in p["train"] if t) < val_first
    # purge: the last training target lies `predict` bars before the validation period of its series
    when, seg, val = np.asarray(data.panel.datetimes), data.splits["train"], data.splits["val"]
    full = (seg.stop > seg.first_target) & (val.stop > val.first_target)
    assert ((val.first_target - seg.stop)[full] == 5).all()
    assert pd.Timestamp(when[val.first_target[full]].min()) == pd.Timestamp(data.split["train_end"])
    # windows stay inside their series: a val range starts at or after the series' first bar
    assert (val.start >= np.asarray(data.panel.offsets[:-1])).all()


def test_explicit_dates_set_the_boundaries(tmp_path):
    cfg = DataConfig(path=str(uneven_overlapping(tmp_path / "csv")), lookback=20, predict=5,
                     train_end="2020-05-01", val_end="2020-08-01")
    data = prepare_data(cfg, tmp_path / "store")
    p = periods(data)
    assert max(t[1] for t in p["train"] if t) < pd.Timestamp("2020-05-01")
    assert min(t[0] for t in p["val"] if t) == pd.Timestamp("2020-05-01")
    assert min(t[0] for t in p["test"] if t) == pd.Timestamp("2020-08-01")
    with pytest.raises(StoreError, match=r"data.split: by_date: the test split\(s\) hold no window"):
        prepare_data(DataConfig(path=cfg.path, lookback=20, predict=5, train_end="2020-05-01",
                                val_end="2030-01-01"), tmp_path / "store2")


def test_per_series_stays_available_and_warns_when_periods_overlap(tmp_path, caplog):
    cfg = DataConfig(path=str(uneven_overlapping(tmp_path / "csv")), lookback=20, predict=5, train_ratio=0.6,
                     val_ratio=0.2, test_ratio=0.2, split="per_series")
    with caplog.at_level(logging.WARNING):
        data = prepare_data(cfg, tmp_path / "store")
    assert data.split == {"mode": "per_series"}
    assert (data.splits["train"].stop - data.splits["train"].first_target).tolist() == [240, 150, 360, 72]
    assert "data.split: per_series: the val period of s2.csv begins" in caplog.text and "split: by_date" in caplog.text


def test_a_bad_pretrained_predictor_is_named_before_the_store_is_built(tmp_path):
    from finetune_csv import config as csv_config
    from finetune_csv.train_sequential import run_finetune
    from tests.model_factory import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    two_files(tmp_path / "csv")
    cfg = csv_config.load(None, values={"data.path": str(tmp_path / "csv"), "paths.base_dir": str(tmp_path / "run"),
                                       "model.pretrained_tokenizer": str(tmp_path / "tok"),
                                       "model.pretrained_predictor": str(tmp_path / "no-such-predictor"),
                                       "data.lookback": 8, "data.predict": 2})
    with pytest.raises((ValueError, OSError), match="no-such-predictor"):
        run_finetune(cfg, skip_tokenizer=True)
    assert not (tmp_path / "run" / "data_store").exists()
