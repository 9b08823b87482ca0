"""Forecasts do not depend on the unit of the price (issue 38): a tiny-priced series (3e-5, 5-minute moves of
~0.2%) and the same series in other units give the same relative bands, seeded, through predict_df; a sampled
price <= 0 is counted per series and warned, never returned silently; a price float32 cannot hold is refused."""
import logging

import numpy as np
import pandas as pd
import pytest

from model import KronosPredictor
from model.errors import DataError
from tests.model_factory import tiny_models

QS = [0.1, 0.5, 0.9]


def tiny_priced(n: int = 200, seed: int = 3, level: float = 3e-5, move: float = 0.002) -> pd.DataFrame:
    """A 24/7 5-minute series priced ~3e-5 with log moves of `move` (as a BTC-quoted altcoin)."""
    rng = np.random.default_rng(seed)
    close = level * np.exp(np.cumsum(rng.normal(0, move, n)))
    open_ = np.r_[close[0], close[:-1]]
    wick = np.abs(rng.normal(0, move / 2, (2, n)))
    return pd.DataFrame({"timestamps": pd.date_range("2024-05-01", periods=n, freq="5min"), "open": open_,
                         "high": np.maximum(open_, close) * (1 + wick[0]),
                         "low": np.minimum(open_, close) * (1 - wick[1]), "close": close,
                         "volume": rng.lognormal(8, 1, n)})


@pytest.fixture(scope="module")
def predictor():
    tok, model = tiny_models(seed=5)
    return KronosPredictor(model, tok, device="cpu", max_context=128, lookback=64)


def relative_bands(predictor, df: pd.DataFrame) -> np.ndarray:
    out = predictor.predict_df(df, prediction_length=16, quantiles=QS, sample_count=40, seed=7)
    return out[[f"close_q{int(q * 100)}" for q in QS]].to_numpy() / df["close"].iloc[-1]  # (16, 3)


@pytest.mark.parametrize("factor", [1e-8, 1e6])
def test_relative_bands_agree_within_one_percent_in_any_unit(predictor, factor):
    df = tiny_priced()
    scaled = df.assign(**{c: df[c] * factor for c in ("open", "high", "low", "close")})
    base, other = relative_bands(predictor, df), relative_bands(predictor, scaled)
    np.testing.assert_allclose(other, base, rtol=0.01)
    assert np.ptp(base[:, 2] - base[:, 0]) > 0 and (base[:, 2] - base[:, 0]).min() > 0  # a band, not a flat line


def test_sampled_prices_at_or_below_zero_are_counted_per_series_and_warned(predictor, caplog):
    wild = tiny_priced(level=0.01, move=0)  # flat at 0.01 but for one spike to 1 in the last 64 bars: the mean is
    wild.loc[170, ["open", "high", "low", "close"]] = 1.0  # 0.13 std above 0, so a z-score of -0.13 is a price < 0
    calm = tiny_priced(seed=4)
    df = pd.concat([wild.assign(id="wild"), calm.assign(id="calm")])
    with caplog.at_level(logging.WARNING, logger="model.predictor"):
        out = predictor.predict_df(df, prediction_length=8, sample_count=20)
    counts = out.attrs["nonpositive_samples"]
    assert set(counts) == {"wild"} and counts["wild"] > 0
    assert f"series 'wild': {counts['wild']}" in caplog.text and "'calm'" not in caplog.text


@pytest.mark.parametrize("value", [1e-46, 5e38])  # 0 and inf in float32
def test_a_price_float32_cannot_hold_is_refused_naming_the_row(predictor, value):
    df = tiny_priced(level=1e-30)
    df.loc[150, "close"] = value
    with pytest.raises(DataError, match=r"float32 cannot hold .* column 'close' at row 150"):
        predictor.predict_df(df.iloc[:, [0, 4, 1, 2, 3]], prediction_length=4)
