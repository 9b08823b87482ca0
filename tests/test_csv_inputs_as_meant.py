"""Every input read as meant (issue 38): epoch integers in a stated unit, Feather and exchange JSON arrays like CSV,
folder entries that are not readable files named, in both doors (the CSV pipeline and predict_df)."""
import json
import os

import numpy as np
import pandas as pd
import pytest

from finetune.utils.store import StoreError
from finetune_csv.prepare import prepare_data
from model.frames import epoch_unit, read_stamps
from tests.csv_reference import candles
from tests.test_csv_data import data_cfg


def first_stamp(folder, tmp_path, **kw) -> pd.Timestamp:
    data = prepare_data(data_cfg(folder, **kw), tmp_path / "store")
    return pd.Timestamp(np.asarray(data.panel.datetimes[data.panel.rows(0)])[0])


@pytest.mark.parametrize("unit, scale", [("s", 10**9), ("ms", 10**6), ("us", 10**3), ("ns", 1)])
def test_epoch_units_are_read_from_their_magnitude_or_set(unit, scale):
    stamps = pd.date_range("2024-05-01", periods=3, freq="5min")
    ints = stamps.as_unit("ns").asi8 // scale
    assert epoch_unit(ints) == unit and epoch_unit(np.array([20240102])) is None
    assert read_stamps(ints, "t").equals(stamps)
    assert read_stamps(pd.Series(ints), "t", unit=unit).equals(stamps)
    assert read_stamps(np.array([20240102, 20240103]), "t")[1] == pd.Timestamp("2024-01-03")  # a date, not 1970


@pytest.mark.parametrize("kind", ["csv", "parquet", "json", "feather"])
def test_epoch_ms_files_feather_and_exchange_json_land_in_the_right_year(tmp_path, kind):
    frame = candles(60, start="2024-05-01 00:00")
    frame["timestamps"] = frame["timestamps"].dt.as_unit("ms").astype("int64")  # epoch ms, as an exchange exports
    folder = tmp_path / "in"
    folder.mkdir()
    path = folder / f"BTCUSDT.{kind}"
    if kind == "json":  # [[ms, "o", "h", "l", "c", "v", close time], ...] with prices as text (Binance klines)
        rows = [[int(r[0]), *map(str, r[1:6]), int(r[0]) + 299_999] for r in frame.itertuples(index=False)]
        path.write_text(json.dumps(rows))
    else:
        getattr(frame, f"to_{kind}")(path, **({} if kind == "feather" else {"index": False}))
    assert first_stamp(folder, tmp_path) == pd.Timestamp("2024-05-01 00:00")
    if kind == "csv":  # the unit stated: seconds would be year 56000+, outside what datetime64[ns] holds
        with pytest.raises(ValueError, match=r"outside 1677-2262.*data.timestamp_unit"):
            prepare_data(data_cfg(folder, timestamp_unit="s"), tmp_path / "store_s")


def test_folder_entries_that_are_not_readable_files_are_named(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    candles(60).to_csv(folder / "a.csv", index=False)
    (folder / "gone.csv").symlink_to(tmp_path / "missing.csv")
    os.mkfifo(folder / "pipe.csv")
    with pytest.raises(StoreError, match=r"not readable regular files .*\['gone.csv', 'pipe.csv'\]"):
        prepare_data(data_cfg(folder), tmp_path / "store")


def test_a_missing_symbol_column_lists_the_columns_and_the_close_match(tmp_path):
    path = tmp_path / "m.csv"
    candles(60, ticker="AAA").to_csv(path, index=False)
    with pytest.raises(ValueError, match=r"symbol column 'tickers' \(data.symbol_column\) not found; did you mean "
                                         r"'ticker'\?; columns: \['timestamps', 'open', .*'ticker'\]"):
        prepare_data(data_cfg(path, symbol_column="tickers"), tmp_path / "store")


def test_predict_df_on_several_series_without_an_id_names_the_column_to_pass(tiny_pair, recwarn):
    from model import KronosPredictor
    from model.errors import DataError

    frame = pd.concat([candles(40, symbol="A"), candles(40, symbol="B")])
    frame["timestamps"] = frame["timestamps"].astype(str).str.replace(" ", "T") + "Z?"  # unreadable text stamps
    predictor = KronosPredictor(tiny_pair[1], tiny_pair[0], device="cpu", max_context=64)
    with pytest.raises(DataError, match=r"not datetimes"):
        predictor.predict_df(frame, prediction_length=2, top_k=1)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]  # no pandas warning before the error
    with pytest.raises(DataError, match=r"strictly increasing.*id_column='symbol'"):
        predictor.predict_df(candles(40, symbol="A").pipe(lambda f: pd.concat([f, f.assign(symbol="B")])),
                             prediction_length=2, top_k=1)


LEAN_DAILY = "".join(f"201310{d:02d} 00:00,{6448000 + 1000 * d},{6468000 + 1000 * d},{6443000 + 1000 * d},"
                     f"{6465000 + 1000 * d},{1264800 + d}\n" for d in range(1, 31))  # Lean: no header, 1/10000 $


def test_a_headerless_csv_is_named_so_and_reads_right_with_header_none(tmp_path):
    from finetune.utils.config_utils import build_config
    from finetune_csv.config import CsvFinetuneConfig, validate

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "spy.csv").write_text(LEAN_DAILY)
    with pytest.raises(StoreError) as e:
        prepare_data(data_cfg(tmp_path / "in"), tmp_path / "store")
    text = str(e.value)
    assert "the file seems to have no header row" in text and "data.header: none" in text
    assert "no 'timestamps' column" not in text  # the first data row is not listed as missing column names
    # the YAML a user writes: positions as numbers
    cfg = build_config(CsvFinetuneConfig, {"data": {
        "path": str(tmp_path / "in"), "header": "none", "lookback": 8, "predict": 4, "train_ratio": 0.6,
        "val_ratio": 0.2, "test_ratio": 0.2, "split": "per_series",
        "columns": {"timestamps": 0, "open": 1, "high": 2, "low": 3, "close": 4, "volume": 5, "amount": None}}})
    validate(cfg)
    data = prepare_data(cfg.data, tmp_path / "store")
    when = pd.DatetimeIndex(np.asarray(data.panel.datetimes))
    assert len(when) == 30 and when[0] == pd.Timestamp("2013-10-01") and when[-1] == pd.Timestamp("2013-10-30")
    values = np.asarray(data.panel.features)[:, 0]  # (6,) the first line, all of it (no row taken as a header)
    np.testing.assert_allclose(values[:5], [6449000, 6469000, 6444000, 6466000, 1264801])
    lines = LEAN_DAILY.splitlines()
    lines[4] = lines[4].replace(",", ",x", 1)  # a bad open on the file's fifth line: named as line 5, not 6
    (tmp_path / "in" / "spy.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(StoreError, match=r"column '1' \(data.columns.open\) has 1 non-numeric .* line\(s\) 5:"):
        prepare_data(cfg.data, tmp_path / "store2")


def test_a_named_header_with_a_misspelled_column_is_not_called_headerless(tmp_path):
    (tmp_path / "in").mkdir()
    frame = candles(30).rename(columns={"close": "clsoe"})
    frame.to_csv(tmp_path / "in" / "a.csv", index=False)
    with pytest.raises(StoreError) as e:
        prepare_data(data_cfg(tmp_path / "in"), tmp_path / "store")
    assert "no header row" not in str(e.value) and "clsoe" in str(e.value)
