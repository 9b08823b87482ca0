"""Predictor API: different context lengths in one batch, long-format predict_df, from_pretrained of a run folder."""
import json

import numpy as np
import pandas as pd
import pytest
import torch

from model import Forecast, KronosPredictor
from model.errors import TokenizerMismatchError
from model.fileio import write_json
from model.hub import weights_fingerprint
from model.predictor import PREDICTOR_INFO_NAME, predictor_info
from tests.model_factory import tiny_models
from tests.test_model_predictor import candles

COLS = ["open", "high", "low", "close", "volume", "amount"]


def _predictor(max_context=64, seed=1):
    tok, pred = tiny_models(seed=seed)
    return KronosPredictor(pred, tok, device="cpu", max_context=max_context)


@pytest.mark.parametrize("max_context", [64, 24])  # 24: some contexts are longer than the window
def test_predict_batch_of_different_lengths_equals_one_by_one_greedy(max_context):
    p = _predictor(max_context)
    frames = [candles(n, seed=s) for s, n in enumerate([25, 17, 30, 17])]
    batch = p.predict_batch([f[0] for f in frames], [f[1] for f in frames], [f[2][:4] for f in frames], 4,
                            top_k=1, verbose=False)
    assert len(batch) == 4
    for (df, x_ts, y_ts), out in zip(frames, batch):
        single = p.predict(df, x_ts, y_ts[:4], 4, top_k=1, verbose=False)
        np.testing.assert_allclose(out.to_numpy(), single.to_numpy(), rtol=1e-5, atol=1e-4)
        assert (out.index == pd.DatetimeIndex(y_ts[:4])).all()
    fcs = p.predict_batch([f[0] for f in frames], [f[1] for f in frames], [f[2][:4] for f in frames], 4,
                          top_k=1, verbose=False, return_samples=True)
    assert all(isinstance(f, Forecast) and f.samples.shape == (1, 4, 6) for f in fcs)


def _long_frame():
    parts = []
    for sid, n, freq, seed in [("A", 30, "5min", 0), ("B", 18, "1h", 1)]:
        df, ts, _ = candles(n, seed=seed, freq=freq)
        df.insert(0, "timestamps", ts.to_numpy())
        df.insert(0, "id", sid)
        parts.append(df)
    return pd.concat(parts, ignore_index=True)


def test_predict_df_long_format_equals_predict_per_series():
    p = _predictor()
    long = _long_frame()
    shuffled = long.sample(frac=1.0, random_state=0)  # rows in any order: sorted per series
    out = p.predict_df(shuffled, prediction_length=3, top_k=1)
    assert list(out.columns) == ["id", "timestamps", *COLS]
    assert len(out) == 6 and set(out["id"]) == {"A", "B"}
    for sid, freq in [("A", "5min"), ("B", "1h")]:
        ctx = long[long.id == sid]
        got = out[out.id == sid]
        expected_ts = pd.date_range(ctx.timestamps.iloc[-1] + pd.Timedelta(freq), periods=3, freq=freq)
        assert (pd.DatetimeIndex(got.timestamps) == expected_ts).all()
        single = p.predict(ctx[COLS].reset_index(drop=True), ctx.timestamps, pd.Series(expected_ts), 3, top_k=1,
                           verbose=False)
        np.testing.assert_allclose(got[COLS].to_numpy(), single.to_numpy(), rtol=1e-5, atol=1e-4)


def test_predict_df_quantile_columns_and_freq():
    p = _predictor()
    torch.manual_seed(0)
    out = p.predict_df(_long_frame(), prediction_length=2, quantiles=[0.1, 0.9], top_p=1.0, freq="D")
    assert [c for c in out.columns if c.startswith("close")] == ["close", "close_q10", "close_q90"]
    assert (out["close_q10"] < out["close_q90"]).all()  # 20 paths by default when quantiles are asked
    b = out[out.id == "B"].timestamps
    assert (b.diff().dropna() == pd.Timedelta("1D")).all()


@pytest.mark.parametrize("case, message", [
    ("no id", "strictly increasing"),  # without an id column the frame is one series: A and B interleave
    ("text timestamps", "not datetimes"),
    ("one row", r"series 'B' has 1 row\(s\): too few to learn its trading calendar"),
    ("bad freq", "not a pandas frequency"),
    ("nan id", "missing ids"),
])
def test_predict_df_errors(case, message):
    p = _predictor()
    df, kw = _long_frame(), {}
    if case == "no id":
        df = df.drop(columns="id")
    elif case == "text timestamps":
        df["timestamps"] = "not a date"
    elif case == "one row":
        df = df.drop(index=range(31, len(df)))
    elif case == "bad freq":
        kw = {"freq": "fortnightly-ish"}
    elif case == "nan id":
        df.loc[2, "id"] = None
    with pytest.raises(ValueError, match=message):
        p.predict_df(df, prediction_length=2, top_k=1, **kw)


def _run_folder(tmp_path, max_context=40):
    """A finetuned run as the engine lays it out: tokenizer/best_model and predictor/best_model."""
    tok, pred = tiny_models(seed=3)
    tok.save_pretrained(tmp_path / "tokenizer" / "best_model")
    folder = tmp_path / "predictor" / "best_model"
    pred.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok.config))
    write_json(folder / PREDICTOR_INFO_NAME, predictor_info(folder, max_context=max_context,
                                                            tokenizer=tmp_path / "tokenizer" / "best_model", clip=4))
    return tok, pred, folder


def test_from_pretrained_run_folder_loads_pair_and_window(tmp_path):
    tok, pred, folder = _run_folder(tmp_path)
    info = json.loads((folder / PREDICTOR_INFO_NAME).read_text())
    assert info == {"max_context": 40, "tokenizer": "../../tokenizer/best_model", "clip": 4.0}
    moved = tmp_path.parent / (tmp_path.name + "_moved")
    tmp_path.rename(moved)  # the relative tokenizer path survives moving the run
    p = KronosPredictor.from_pretrained(moved / "predictor" / "best_model", device="cpu")
    assert p.max_context == 40 and p.clip == 4.0
    assert all(torch.equal(a, b) for a, b in zip(p.tokenizer.state_dict().values(), tok.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(p.model.state_dict().values(), pred.state_dict().values()))
    ref = KronosPredictor(pred, tok, device="cpu", max_context=40, clip=4)
    df, x_ts, y_ts = candles(30)
    np.testing.assert_array_equal(p.predict(df, x_ts, y_ts[:3], 3, top_k=1, verbose=False).to_numpy(),
                                  ref.predict(df, x_ts, y_ts[:3], 3, top_k=1, verbose=False).to_numpy())
    p2 = KronosPredictor.from_pretrained(moved / "predictor" / "best_model", device="cpu", max_context=16)
    assert p2.max_context == 16


def test_from_pretrained_says_a_context_it_cannot_know_is_assumed(tmp_path, caplog):
    """Issue 48 item 2: no recorded lookback (the published weights' case): the log says max_context is assumed;
    a recorded one is used and nothing is said."""
    _, _, folder = _run_folder(tmp_path)
    with caplog.at_level("INFO", logger="model.predictor"):
        p = KronosPredictor.from_pretrained(folder, device="cpu")
    assert p.lookback == 40
    assert any("records no training window" in m and "max_context=40, is assumed, not known" in m
               for m in caplog.messages)
    info = json.loads((folder / PREDICTOR_INFO_NAME).read_text())
    write_json(folder / PREDICTOR_INFO_NAME, {**info, "lookback": 24})
    caplog.clear()
    with caplog.at_level("INFO", logger="model.predictor"):
        assert KronosPredictor.from_pretrained(folder, device="cpu").lookback == 24
    assert not any("training window" in m for m in caplog.messages)


def test_from_pretrained_errors(tmp_path):
    tok, _, folder = _run_folder(tmp_path)
    (folder / PREDICTOR_INFO_NAME).unlink()
    with pytest.raises(ValueError, match="records no tokenizer.*pass tokenizer="):
        KronosPredictor.from_pretrained(folder, device="cpu")
    p = KronosPredictor.from_pretrained(folder, tokenizer=tmp_path / "tokenizer" / "best_model", device="cpu")
    assert p.max_context == 512 and p.clip == 5  # no kronos_predictor.json: the published defaults
    other, _ = tiny_models(seed=9)
    other.config["beta"] = 0.5  # a differently configured tokenizer than the one it was trained with
    with pytest.raises(ValueError, match="tokenizer_config.json.*\\['beta'\\] differ"):
        KronosPredictor.from_pretrained(folder, tokenizer=other, device="cpu")
    (folder / PREDICTOR_INFO_NAME).write_text(json.dumps({"max_context": "big"}))
    with pytest.raises(ValueError, match="max_context must be an integer"):
        KronosPredictor.from_pretrained(folder, tokenizer=tok, device="cpu")
    with pytest.raises(TypeError, match="unexpected arguments \\['revison'\\]"):
        KronosPredictor.from_pretrained(folder, tokenizer=tok, revison="x")
    with pytest.raises(ValueError, match="max_context must be an integer >= 1"):
        predictor_info(folder, max_context=0)


def test_from_pretrained_refuses_a_swapped_tokenizer_naming_both_fingerprints(tmp_path):
    tok, _, folder = _run_folder(tmp_path)
    trained = weights_fingerprint(tok)
    write_json(folder / PREDICTOR_INFO_NAME, predictor_info(folder, max_context=40, tokenizer=tmp_path / "tokenizer" /
                                                            "best_model", tokenizer_sha256=trained, clip=4))
    assert KronosPredictor.from_pretrained(folder, device="cpu").max_context == 40  # the recorded pair
    other, _ = tiny_models(seed=9)  # the same config (tokenizer_config.json matches), other weights
    other.save_pretrained(tmp_path / "tokenizer" / "best_model")  # e.g. the tokenizer stage retrained in place
    swapped = f"trained with tokenizer weights sha256 {trained[:12]} .* has sha256 {weights_fingerprint(other)[:12]}"
    with pytest.raises(TokenizerMismatchError, match=swapped):
        KronosPredictor.from_pretrained(folder, device="cpu")
    with pytest.raises(TokenizerMismatchError, match="the tokenizer passed has sha256"):
        KronosPredictor.from_pretrained(folder, tokenizer=other, device="cpu")
    assert KronosPredictor.from_pretrained(folder, tokenizer=tok, device="cpu").max_context == 40


def test_from_pretrained_published_pair_via_hub_ids(tmp_path, monkeypatch):
    tok, pred = tiny_models(seed=4)
    tok.save_pretrained(tmp_path / "tok")
    pred.save_pretrained(tmp_path / "pred")
    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw.get("revision")))
        return str(tmp_path / {"NeoQuasar/Kronos-small": "pred", "NeoQuasar/Kronos-Tokenizer-base": "tok"}[repo_id])
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    p = KronosPredictor.from_pretrained("NeoQuasar/Kronos-small", tokenizer="NeoQuasar/Kronos-Tokenizer-base",
                                        device="cpu", revision="main")
    assert calls == [("NeoQuasar/Kronos-small", "main"), ("NeoQuasar/Kronos-Tokenizer-base", "main")]
    assert p.max_context == 512


def test_mismatched_pair_is_rejected():
    tok, pred = tiny_models(seed=1, s1_bits=5, s2_bits=5)
    with pytest.raises(ValueError, match="s1/s2 bits 4/4 but the predictor expects 5/5"):
        KronosPredictor(pred, tok, device="cpu")

