"""The static decoding step (the one a CUDA graph records) and batched forecasting.

What is compared: greedy tokens of the static step equal the eager cached generator's exactly (inside, across and
beyond the predictor window, several sample paths sharing one prefill); its sampler (the exponential race) draws the
filtered softmax distribution; a whole static step draws the model's next-token distribution; `predict_df` in
batches equals one batch, never forecasting more series at once than asked.
"""
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from model import KronosPredictor, generate_tokens
from model.generation import filter_logits, race_sample
from tests.model_factory import tiny_models


def _ids(batch, n_ctx, pred_len, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 16, (batch, n_ctx), generator=g), torch.randint(0, 16, (batch, n_ctx), generator=g),
            torch.randint(0, 7, (batch, n_ctx + pred_len, 5), generator=g))


@pytest.mark.parametrize("batch, n_ctx, pred_len, max_context, samples", [
    (3, 20, 10, 64, 1),  # everything fits in the window
    (4, 10, 30, 24, 1),  # the window starts sliding during the forecast
    (2, 40, 8, 32, 3),   # the context alone is longer than the window; three paths per series
    (5, 32, 5, 32, 2),   # the context fills the window exactly
])
@pytest.mark.parametrize("seed", [0, 3])
def test_static_step_greedy_tokens_equal_the_cached_generator(batch, n_ctx, pred_len, max_context, samples, seed):
    _, pred = tiny_models(seed=seed)
    s1, s2, stamps = _ids(batch, n_ctx, pred_len, seed)
    eager = generate_tokens(pred, s1, s2, stamps, pred_len, max_context, top_k=1, sample_count=samples)
    static = generate_tokens(pred, s1, s2, stamps, pred_len, max_context, top_k=1, sample_count=samples,
                             decode="static")
    assert static[0].shape == (batch * samples, n_ctx + pred_len)
    assert torch.equal(eager[0], static[0]) and torch.equal(eager[1], static[1])


def test_static_predictor_reproduces_the_greedy_forecast_and_graph_falls_back_to_it_on_cpu():
    tok, pred = tiny_models(seed=1)
    rng = np.random.default_rng(0)
    close = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, 40)))
    df = pd.DataFrame({"open": close, "high": close * 1.01, "low": close * 0.99, "close": close})
    ts = pd.Series(pd.date_range("2024-01-02", periods=52, freq="5min"))
    outs = [KronosPredictor(pred, tok, device="cpu", max_context=32, decode=d).predict(
        df, ts[:40], ts[40:], 12, top_k=1, verbose=False) for d in ("auto", "static", "graph")]
    for out in outs[1:]:
        pd.testing.assert_frame_equal(outs[0], out)


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 1.0, 1.0), (3, 1.0, 0.7), (0, 0.8, 1.3)])
def test_race_sampler_draws_the_filtered_softmax(top_k, top_p, temperature):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -0.5, -3.0]]).repeat(40_000, 1)
    torch.manual_seed(0)
    drawn = race_sample(logits, temperature, top_k, top_p)[:, 0]
    expected = F.softmax(filter_logits(logits[:1], temperature, top_k, top_p), dim=-1)[0]
    freq = torch.bincount(drawn, minlength=6).double() / len(drawn)
    sigma = (expected * (1 - expected) / len(drawn)).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma + 1e-12).all(), (freq, expected)
    assert (freq[expected == 0] == 0).all()  # filtered tokens are never drawn


CUDA = pytest.mark.cuda  # skipped without a GPU (tests/conftest.py); the only tests that see one


@pytest.mark.parametrize("device, decode", [("cpu", "static"), pytest.param("cuda", "graph", marks=CUDA)])
def test_static_step_samples_the_models_next_token_distribution(device, decode):
    """One series, 20,000 paths sharing its prefill: the first drawn s1 follows softmax(logits / 0.7), and so does
    the second (drawn by the recorded step) among the paths whose first pair is the most frequent one."""
    _, pred = tiny_models(seed=2)
    s1, s2, stamps = _ids(1, 12, 2, seed=2)
    torch.manual_seed(0)
    out1, out2 = generate_tokens(pred.to(device), s1.to(device), s2.to(device), stamps.to(device), 2, 32,
                                 temperature=0.7, top_k=0, top_p=1.0, sample_count=20_000, decode=decode)
    out1, out2, pred = out1.cpu(), out2.cpu(), pred.cpu()
    pairs, counts = torch.unique(out1[:, 12] * 16 + out2[:, 12], return_counts=True)
    top = pairs[counts.argmax()]
    same = out1[:, 12] * 16 + out2[:, 12] == top
    for ctx1, ctx2, drawn in [(s1, s2, out1[:, 12]), (torch.cat([s1, top.view(1, 1) // 16], 1),
                                                      torch.cat([s2, top.view(1, 1) % 16], 1), out1[same, 13])]:
        with torch.no_grad():
            logits = pred.decode_s1(ctx1, ctx2, stamps[:, :ctx1.shape[1]])[0][0, -1]
        expected = F.softmax(logits / 0.7, dim=-1).double()
        freq = torch.bincount(drawn, minlength=16).double() / len(drawn)
        sigma = (expected * (1 - expected) / len(drawn)).sqrt()
        assert len(drawn) > 1000 and ((freq - expected).abs() <= 5 * sigma + 1e-12).all(), (freq, expected)


def _long(n_series=5, n=30):
    rng = np.random.default_rng(1)
    frames = []
    for i in range(n_series):
        close = 50 * (i + 1) * np.exp(np.cumsum(rng.normal(0, 0.01, n + 3 * i)))
        frames.append(pd.DataFrame({"id": f"S{i}", "timestamps": pd.date_range("2024-03-01", periods=len(close),
                                                                                  freq="h"),
                                    "open": close, "high": close * 1.01, "low": close * 0.99, "close": close}))
    return pd.concat(frames, ignore_index=True)


def test_predict_df_in_batches_equals_one_batch_and_bounds_the_batch(monkeypatch):
    tok, pred = tiny_models(seed=1)
    kp = KronosPredictor(pred, tok, device="cpu", max_context=32)
    long = _long()
    whole = kp.predict_df(long, prediction_length=4, top_k=1)
    sizes = []
    generate = kp.generate
    monkeypatch.setattr(kp, "generate", lambda x, *a, **k: sizes.append(len(x)) or generate(x, *a, **k))
    batched = kp.predict_df(long, prediction_length=4, top_k=1, batch_size=2)
    pd.testing.assert_frame_equal(whole, batched)
    assert max(sizes) <= 2 and sum(sizes) == 5  # each series forecast once, at most two at a time
    with pytest.raises(ValueError, match="batch_size"):
        kp.predict_df(long, prediction_length=4, batch_size=0)


@CUDA
def test_cuda_graph_greedy_tokens_equal_the_cached_generator_and_replay_across_calls():
    _, pred = tiny_models(seed=0)
    pred, graphs = pred.cuda(), {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture (the eager fallback) fails the test
        for batch, n_ctx, pred_len, max_context, samples in [(3, 20, 10, 64, 2), (4, 10, 30, 24, 1),
                                                             (3, 20, 10, 64, 2)]:
            s1, s2, stamps = (t.cuda() for t in _ids(batch, n_ctx, pred_len, 0))
            eager = generate_tokens(pred, s1, s2, stamps, pred_len, max_context, top_k=1, sample_count=samples)
            graph = generate_tokens(pred, s1, s2, stamps, pred_len, max_context, top_k=1, sample_count=samples,
                                    decode="graph", graphs=graphs)
            assert torch.equal(eager[0], graph[0]) and torch.equal(eager[1], graph[1])
    assert len(graphs) == 2  # the third call replayed the first one's graph
