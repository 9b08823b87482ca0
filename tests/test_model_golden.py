"""Same numbers as the original Kronos implementation.

tests/fixtures/kronos_golden/ holds a tiny random tokenizer + predictor in the published format and the outputs
the ORIGINAL code (github.com/shiyu-coder/Kronos) produced from them (made by tests/fixtures/make_kronos_golden.py):
token ids, reconstructions, logits and greedy forecasts inside, across and beyond the predictor window.
"""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from model import Kronos, KronosPredictor, KronosTokenizer, calc_time_stamps

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "kronos_golden"
COLS = ["open", "high", "low", "close", "volume", "amount"]


@pytest.fixture(scope="module")
def case():
    df = pd.read_csv(GOLDEN / "candles.csv", parse_dates=["timestamps"])
    golden = dict(np.load(GOLDEN / "golden.npz"))
    tok = KronosTokenizer.from_pretrained(GOLDEN / "tokenizer").eval()
    pred = Kronos.from_pretrained(GOLDEN / "predictor").eval()
    return df, golden, tok, pred


def test_tokens_reconstruction_and_logits_match_the_original(case):
    df, golden, tok, pred = case
    x = torch.tensor(((df[COLS] - df[COLS].mean()) / (df[COLS].std(ddof=0) + 1e-5)).to_numpy(np.float32))[None]
    stamp = torch.tensor(calc_time_stamps(df.timestamps).to_numpy())[None]
    with torch.no_grad():
        s1, s2 = tok.encode(x, half=True)
        np.testing.assert_array_equal(s1.numpy(), golden["encode_s1"])
        np.testing.assert_array_equal(s2.numpy(), golden["encode_s2"])
        np.testing.assert_allclose(tok.decode((s1, s2), half=True).numpy(), golden["decode"], rtol=0, atol=1e-6)
        l1, l2 = pred(s1, s2, stamp, use_teacher_forcing=True, s1_targets=s1)
    np.testing.assert_allclose(l1.numpy(), golden["s1_logits"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(l2.numpy(), golden["s2_logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("use_cache, decode", [(True, "eager"), (False, "eager"), (True, "static")])
@pytest.mark.parametrize("ctx, pred_len", [(40, 6), (40, 20), (60, 10)])  # max_context 48: inside, across, beyond
def test_greedy_forecast_matches_the_original(case, ctx, pred_len, use_cache, decode):
    df, golden, tok, pred = case
    ts = pd.Series(pd.date_range(df.timestamps.iloc[0], periods=len(df) + 40, freq="5min"))
    # lookback=ctx: the original normalised over the whole history passed (the default cuts it to max_context).
    p = KronosPredictor(pred, tok, device="cpu", max_context=48, clip=5, use_cache=use_cache, lookback=ctx,
                        decode=decode)
    y = p.predict(df[COLS].iloc[:ctx], ts.iloc[:ctx], ts.iloc[ctx:ctx + pred_len], pred_len, T=1.0, top_k=1,
                  verbose=False)
    np.testing.assert_allclose(y.to_numpy(), golden[f"forecast_{ctx}_{pred_len}"], rtol=1e-6, atol=1e-6)
