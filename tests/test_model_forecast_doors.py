"""The Python doors of KronosPredictor: the history is cut to the trained context, quantiles need enough
paths, one column resolver (any case, aliases, a DatetimeIndex), `close_q10` naming, a self-contained best_model/."""
import json
import logging
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from model import KronosPredictor
from model.errors import PathError
from model.features import ColumnError, quantile_column, resolve_columns
from model.fileio import write_json
from model.predictor import PREDICTOR_INFO_NAME, predictor_info
from tests.model_factory import tiny_models
from tests.test_model_predictor import candles

COLS = ["open", "high", "low", "close", "volume", "amount"]


def _predictor(**kw):
    tok, pred = tiny_models(seed=1)
    return KronosPredictor(pred, tok, device="cpu", **{"max_context": 40, "lookback": 24, **kw})


def test_a_long_history_forecasts_exactly_as_its_tail(caplog):
    p = _predictor()
    df, x_ts, y_ts = candles(100)
    tail = df.iloc[-24:].reset_index(drop=True), x_ts.iloc[-24:]
    with caplog.at_level(logging.WARNING, logger="model.predictor"):
        greedy = p.predict(df, x_ts, y_ts[:6], 6, top_k=1, verbose=False)
        np.testing.assert_array_equal(greedy.to_numpy(),
                                      p.predict(*tail, y_ts[:6], 6, top_k=1, verbose=False).to_numpy())
        torch.manual_seed(5)
        full = p.predict(df, x_ts, y_ts[:6], 6, sample_count=3, return_samples=True, verbose=False)
        torch.manual_seed(5)
        short = p.predict(*tail, y_ts[:6], 6, sample_count=3, return_samples=True, verbose=False)
        np.testing.assert_array_equal(full.samples, short.samples)
        assert (full.samples.std(axis=0) > 0).any()  # really sampled
        batch = p.predict_batch([df, tail[0]], [x_ts, tail[1]], [y_ts[:6]] * 2, 6, top_k=1, verbose=False)
        np.testing.assert_array_equal(batch[0].to_numpy(), batch[1].to_numpy())
    cut = [r for r in caplog.records if "rows of history" in r.getMessage()]
    assert len(cut) == 1 and "100 rows" in cut[0].getMessage() and "last 24" in cut[0].getMessage()
    # The forecast differs from normalising over the whole history (what the original code did).
    whole = _predictor(lookback=100).predict(df, x_ts, y_ts[:6], 6, top_k=1, verbose=False)
    assert not np.allclose(whole.to_numpy(), greedy.to_numpy())


def test_predict_df_cuts_each_series_too():
    p = _predictor()
    df, ts, _ = candles(60)
    long = df.assign(timestamps=ts.to_numpy(), id="A")
    a = p.predict_df(long, prediction_length=3, top_k=1)
    b = p.predict_df(long.iloc[-24:], prediction_length=3, top_k=1)
    pd.testing.assert_frame_equal(a, b)


def test_quantiles_from_too_few_paths_are_refused():
    p = _predictor()
    df, x_ts, y_ts = candles(30)
    with pytest.raises(ValueError, match="1 sample path.*sample_count >= 20"):
        p.predict(df, x_ts, y_ts[:3], 3, quantiles=[0.1, 0.9], verbose=False)
    with pytest.raises(ValueError, match="sample_count >= 20"):
        p.predict_df(df.assign(timestamps=x_ts.to_numpy()), prediction_length=3, quantiles=[0.1], sample_count=5)
    fc = p.predict(df, x_ts, y_ts[:3], 3, quantiles=[0.1, 0.9], sample_count=20, top_p=1.0, verbose=False)
    assert (fc.quantiles[0.1]["close"] < fc.quantiles[0.9]["close"]).all()
    table = fc.table()
    assert list(table.columns[:8]) == [*COLS, "open_q10", "high_q10"] and "close_q90" in table
    np.testing.assert_array_equal(table["close_q90"].to_numpy(), fc.quantiles[0.9]["close"].to_numpy())


def test_quantile_column_naming():
    assert [quantile_column("close", q) for q in (0.1, 0.5, 0.9, 0.025, 0.999, 1.0)] == \
        ["close_q10", "close_q50", "close_q90", "close_q2.5", "close_q99.9", "close_q100"]


def _user_frame(index=False):
    """One series as users have it: capitalised columns, `Date` as a column or as the DatetimeIndex, no amount."""
    df, ts, _ = candles(30, freq="1D", start="2024-01-01")
    user = df[["open", "high", "low", "close", "volume"]].rename(columns=str.capitalize)
    user.insert(0, "Date", ts.to_numpy())
    return user.set_index("Date") if index else user


@pytest.mark.parametrize("index", [False, True])
def test_predict_df_takes_capitalised_columns_and_a_date_index(index):
    p = _predictor()
    out = p.predict_df(_user_frame(index), prediction_length=3, top_k=1, quantiles=[0.1, 0.9])
    assert list(out.columns[:2]) == ["timestamps" if index else "Date", "open"] and "close_q10" in out
    df, x_ts, y_ts = candles(30, freq="1D", start="2024-01-01")
    ref = p.predict(df[["open", "high", "low", "close", "volume"]], x_ts, y_ts[:3], 3, top_k=1, sample_count=20,
                    verbose=False)  # predict_df draws 20 paths when quantiles are asked
    np.testing.assert_array_equal(out[COLS].to_numpy(), ref.to_numpy())  # amount derived as volume x mean(OHLC)
    assert (pd.DatetimeIndex(out.iloc[:, 0]) == pd.DatetimeIndex(y_ts[:3])).all()


def test_predict_df_typo_gets_a_close_match_and_explicit_columns_win():
    p = _predictor()
    user = _user_frame().rename(columns={"Close": "Clsoe"})
    with pytest.raises(ColumnError, match="predict_df's df: no 'close' column.*did you mean 'Clsoe'"):
        p.predict_df(user, prediction_length=2, top_k=1)
    out = p.predict_df(user, prediction_length=2, top_k=1, columns={"close": "Clsoe"})
    assert len(out) == 2 and np.isfinite(out[COLS].to_numpy()).all()
    with pytest.raises(ColumnError, match="no id column 'symbol'"):
        p.predict_df(user, prediction_length=2, top_k=1, id_column="symbol")


def test_resolve_columns_rules():
    names = ["Trade_Date", "OPEN", "high", "Low", "close", "Vol", "Turnover", "extra"]
    assert resolve_columns(names, where="f.csv") == {"timestamps": "Trade_Date", "open": "OPEN", "high": "high",
                                                     "low": "Low", "close": "close", "volume": "Vol",
                                                     "amount": "Turnover"}
    got = resolve_columns(["ts", "o", "h", "l", "c"], {"timestamps": "ts", "open": "o", "high": "h", "low": "l",
                                                       "close": "c"}, where="f.csv")
    assert got["open"] == "o" and got["volume"] is None and got["amount"] is None
    # the field's own name wins over an alias; an explicit None means "not a column" (e.g. a DatetimeIndex)
    assert resolve_columns(["timestamps", "date", "open", "high", "low", "close"], where="x")["timestamps"] == \
        "timestamps"
    assert resolve_columns(["open", "high", "low", "close"], {"timestamps": None}, where="x")["timestamps"] is None
    for bad, message in [
        (["date", "open", "high", "low", "close", "Close"], "columns \\['close', 'Close'\\] all match 'close'"),
        (["date", "open", "high", "low", "close", "close"], "all match 'close'"),
        (["date", "time", "open", "high", "low", "close"], "all match 'timestamps'"),
        (["open", "high", "low", "close"], "f.csv: no 'timestamps' column \\(or one of \\['timestamp', 'date'"),
    ]:
        with pytest.raises(ColumnError, match=message):
            resolve_columns(bad, where="f.csv")
    with pytest.raises(ColumnError, match="'Adj Close' \\(mapped to close\\) is not a column"):
        resolve_columns(["date", "open", "high", "low", "close"], {"close": "Adj Close"}, where="x")
    with pytest.raises(ColumnError, match="\\['price'\\] are not candle fields"):
        resolve_columns(["date", "open", "high", "low", "close"], {"price": "close"}, where="x")
    with pytest.raises(ColumnError, match="1012 more"):  # a huge header never makes a huge message
        resolve_columns([f"c{i}" for i in range(1024)], where="x")
    assert issubclass(ColumnError, ValueError)


def _best_model(folder, tok, pred, tokenizer_inside=True):
    """A finetuned predictor folder as the engine writes it: weights, tokenizer_config.json, kronos_predictor.json
    and (self-contained) the tokenizer in tokenizer/."""
    pred.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok.config))
    tok_dir = folder / "tokenizer" if tokenizer_inside else folder.parent.parent / "tokenizer" / "best_model"
    tok.save_pretrained(tok_dir)
    write_json(folder / PREDICTOR_INFO_NAME, predictor_info(folder, max_context=40, lookback=24, tokenizer=tok_dir,
                                                            clip=4))


def test_a_copied_self_contained_best_model_forecasts_identically(tmp_path):
    tok, pred = tiny_models(seed=3)
    _best_model(tmp_path / "run" / "best_model", tok, pred)
    assert json.loads((tmp_path / "run/best_model" / PREDICTOR_INFO_NAME).read_text())["tokenizer"] == "tokenizer"
    shutil.copytree(tmp_path / "run" / "best_model", tmp_path / "elsewhere" / "copy")
    shutil.rmtree(tmp_path / "run")
    p = KronosPredictor.from_pretrained(tmp_path / "elsewhere" / "copy", device="cpu")
    assert (p.max_context, p.lookback, p.clip) == (40, 24, 4.0)
    ref = KronosPredictor(pred, tok, device="cpu", max_context=40, lookback=24, clip=4)
    df, x_ts, y_ts = candles(50)
    np.testing.assert_array_equal(p.predict(df, x_ts, y_ts[:4], 4, top_k=1, verbose=False).to_numpy(),
                                  ref.predict(df, x_ts, y_ts[:4], 4, top_k=1, verbose=False).to_numpy())


def test_a_moved_folder_whose_tokenizer_stayed_behind_names_the_file_and_the_base(tmp_path):
    tok, pred = tiny_models(seed=3)
    _best_model(tmp_path / "predictor" / "best_model", tok, pred, tokenizer_inside=False)
    shutil.copytree(tmp_path / "predictor" / "best_model", tmp_path / "moved")
    with pytest.raises(PathError) as info:
        KronosPredictor.from_pretrained(tmp_path / "moved", device="cpu")
    message = str(info.value)
    assert str(tmp_path / "moved" / PREDICTOR_INFO_NAME) in message
    assert "'../../tokenizer/best_model', relative to the predictor folder" in message and "does not exist" in message
    p = KronosPredictor.from_pretrained(tmp_path / "moved", tokenizer=tok, device="cpu")  # the way out it names
    assert p.lookback == 24
