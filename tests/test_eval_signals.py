"""finetune.evaluation Qlib labels, signal analysis and baseline signals on a tiny provider built by qlib_builder."""

import json
import logging
import warnings

import numpy as np
import pandas as pd
import pytest

from finetune.evaluation.signals import (
    BaselineSettings,
    analyse_signal,
    baseline_expressions,
    baseline_signals,
    forward_labels,
    ic_decay,
    label_expression,
    plot_ic_decay,
    quantile_group_returns,
)
from finetune.qlib_builder import SubstituteBenchmarkWarning, build_qlib_provider
from finetune.synthetic import generate_ohlcv
from model.fileio import strict_json

qlib = pytest.importorskip("qlib")
START, END = "2023-01-02", "2023-06-30"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(close and open panels (days, symbols) as the store holds them, provider folder)."""
    frames = generate_ohlcv(10, None, "1D", start=START, end=END, seed=5)
    frames["SH600003"] = frames["SH600003"].drop(index=[40, 41]).reset_index(drop=True)  # missing days
    frames["SH600004"].loc[60, "volume"] = 0.0  # a suspended day
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SubstituteBenchmarkWarning)
        out = build_qlib_provider(frames, tmp_path_factory.mktemp("q") / "p", universe="mkt")
    calendar = pd.bdate_range(START, END)
    panels = {}
    for field in ("close", "open"):
        panel = pd.DataFrame({
            s: df.set_index(pd.to_datetime(df["timestamps"]))[field].where(df["volume"].to_numpy() > 0)
            for s, df in frames.items()
        }).reindex(calendar)
        panels[field] = panel
    return panels, out


@pytest.fixture
def on_store(store):
    qlib.init(provider_uri=str(store[1]), region="cn", kernels=1, expression_cache=None, dataset_cache=None,
              logging_level=logging.WARNING)
    return store


def _stack(panel: pd.DataFrame) -> pd.Series:
    s = panel.stack(future_stack=True)
    s.index.names = ["datetime", "instrument"]
    return s


def test_label_expressions():
    assert label_expression("close", 1) == "Ref($close, -2) / Ref($close, -1) - 1"
    assert label_expression("$open", 3) == "Ref($open, -4) / Ref($open, -1) - 1"
    with pytest.raises(ValueError, match="backtest.deal_price"):
        label_expression("high")
    with pytest.raises(ValueError, match=">= 1"):
        label_expression("close", 0)


@pytest.mark.parametrize("deal", ["close", "open"])
def test_labels_follow_the_trade_on_the_market_calendar(on_store, deal):
    panels, _ = on_store
    got = forward_labels("mkt", START, END, deal_price=deal, horizons=3)
    assert list(got.columns) == ["label_1", "label_2", "label_3"] and got.index.names == ["datetime", "instrument"]
    price = panels[deal]
    for h in (1, 2, 3):
        expected = _stack(price.shift(-1 - h) / price.shift(-1) - 1).reindex(got.index)
        np.testing.assert_allclose(got[f"label_{h}"], expected, rtol=2e-6, atol=1e-6)  # float32 store
    # Entering on a missing (SH600003) or suspended (SH600004) day gives no label; the day before it neither.
    day = pd.bdate_range(START, END)
    assert np.isnan(got.loc[(day[39], "SH600003"), "label_1"]) and np.isnan(got.loc[(day[59], "SH600004"), "label_1"])
    assert np.isnan(got.loc[(day[58], "SH600004"), "label_1"])  # exit day suspended
    assert np.isfinite(got.loc[(day[57], "SH600004"), "label_1"])
    assert got["label_1"].xs(day[-2], level="datetime").isna().all()  # t+2 is past the store's last day


def test_perfect_foresight_scores_ic_one_and_the_best_long_short(on_store):
    labels = forward_labels("mkt", "2023-02-01", "2023-04-28", horizons=2)
    perfect = labels["label_1"].dropna()
    res = analyse_signal(perfect, labels, quantile=0.2, n_groups=5)
    assert res["label_1"]["ic"]["mean"] == pytest.approx(1.0)
    assert res["label_1"]["rank_ic"]["mean"] == pytest.approx(1.0)
    assert 0 < res["label_2"]["ic"]["mean"] < 1  # a 1-day perfect score knows only part of the 2-day move
    # Long-short = (mean of the top n labels - mean of the bottom n) / 2 each day, n = int(0.2 * stocks that day):
    # the most any score can earn.
    def best(d):
        v, n = np.sort(d.to_numpy()), int(len(d) * 0.2)
        return (v[-n:].mean() - v[:n].mean()) / 2
    expected = perfect.groupby(level="datetime").apply(best).mean()
    assert res["label_1"]["long_short"]["mean"] == pytest.approx(expected)
    rng = np.random.default_rng(0)
    for _ in range(3):
        noisy = perfect + rng.normal(0, perfect.std(), len(perfect))
        assert analyse_signal(noisy, labels[["label_1"]])["label_1"]["long_short"]["mean"] < expected
    top = perfect.groupby(level="datetime").apply(lambda d: np.sort(d.to_numpy())[-int(len(d) * 0.2):].mean()
                                                  - d.mean()).mean()
    assert res["label_1"]["excess_return"]["mean"] == pytest.approx(top)
    groups = res["label_1"]["group_means"]
    assert groups == sorted(groups) and res["label_1"]["excess_return"]["mean"] > 0
    assert "t" in res["label_1"]["ic"] and res["label_1"]["days"] > 55


def test_quantile_groups_by_hand():
    idx = pd.MultiIndex.from_product([pd.to_datetime(["2024-01-02"]), list("abcdef")], names=["datetime", "instrument"])
    pred = pd.Series([6.0, 5, 4, 3, 2, 1], index=idx)
    label = pd.Series([0.6, 0.5, 0.4, 0.3, 0.2, 0.1], index=idx)
    table = quantile_group_returns(pred, label, n_groups=3)
    np.testing.assert_allclose(table.iloc[0].to_numpy(), [0.15, 0.35, 0.55])


def test_ic_decay_plot(on_store, tmp_path):
    labels = forward_labels("mkt", "2023-03-01", "2023-03-31", horizons=3)
    base = baseline_signals("mkt", "2023-03-01", "2023-03-31")
    runs = [analyse_signal(base["momentum"].dropna(), labels), analyse_signal(base["reversal"].dropna(), labels)]
    table = ic_decay(runs[0])
    assert list(table.index) == [1, 2, 3] and list(table.columns) == ["ic", "rank_ic", "ic_t", "long_short"]
    png = plot_ic_decay({"momentum": table, "reversal": ic_decay(runs[1])}, tmp_path / "ic_decay.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    json.dumps(strict_json({"runs": runs}), allow_nan=False)  # metrics.json-ready


def test_baselines_from_the_same_data(on_store):
    panels, _ = on_store
    got = baseline_signals("mkt", "2023-02-01", END, BaselineSettings(momentum_window=10, reversal_window=3))
    close = panels["close"]
    mom = _stack(close / close.shift(10) - 1).reindex(got.index)
    rev = _stack(close.shift(3) / close - 1).reindex(got.index)
    np.testing.assert_allclose(got["momentum"], mom, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(got["reversal"], rev, rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match="momentum_window"):
        baseline_expressions(BaselineSettings(momentum_window=0))
