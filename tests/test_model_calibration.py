"""Split-conformal calibration of the sampled bands (fit on validation windows, applied to new paths),
stored in kronos_predictor.json and applied by KronosPredictor unless calibrated=False."""
import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from model import Kronos, KronosPredictor, KronosTokenizer
from model.calibration import apply_calibration, fit_calibration, fit_windows, write_calibration
from model.errors import DataError
from model.fileio import write_json
from model.predictor import PREDICTOR_INFO_NAME, predictor_info
from tests.model_factory import tiny_models
from tests.test_model_predictor import candles


def _draws(rng, windows, samples=200, horizons=3, model_sd=0.01, true_sd=0.02):
    """A 'model' whose log returns are N(0, model_sd^2 h) while outcomes are N(0, true_sd^2 h): bands too narrow."""
    scale = np.sqrt(np.arange(1, horizons + 1))
    last = rng.uniform(50, 150, windows)
    paths = last[:, None, None] * np.exp(rng.normal(0, model_sd, (windows, samples, horizons)) * scale)
    outcomes = last[:, None] * np.exp(rng.normal(0, true_sd, (windows, horizons)) * scale)
    return paths, outcomes, last


def _coverage(paths, outcomes, level):
    lo, hi = np.quantile(paths, [(1 - level) / 2, (1 + level) / 2], axis=1)  # (W, H)
    return float(((outcomes >= lo) & (outcomes <= hi)).mean())


def test_calibration_reaches_nominal_coverage_on_fresh_draws():
    rng = np.random.default_rng(0)
    calibration = fit_calibration(*_draws(rng, 2000))
    assert json.loads(json.dumps(calibration, allow_nan=False)) == calibration  # strict JSON
    assert calibration["levels"][-1] == 0.95 and len(calibration["margins"]) == 10 and calibration["windows"] == 2000
    paths, outcomes, last = _draws(rng, 4000)  # held out: never seen by the fit
    calibrated = apply_calibration(calibration, paths, last)
    assert calibrated.shape == paths.shape
    for level in (0.5, 0.8):
        raw, cal = _coverage(paths, outcomes, level), _coverage(calibrated, outcomes, level)
        assert raw < level - 0.2  # the model's bands are far too narrow
        assert abs(cal - level) < 0.03, (level, raw, cal)
    # Per-path medians stay (a path never crosses the median), so the point forecast keeps its centre.
    np.testing.assert_allclose(np.median(calibrated, axis=1), np.median(paths, axis=1), rtol=1e-5)


def test_too_wide_bands_are_narrowed():
    rng = np.random.default_rng(1)
    calibration = fit_calibration(*_draws(rng, 1500, model_sd=0.03, true_sd=0.01))
    assert (np.asarray(calibration["margins"]) < 0).all()
    paths, outcomes, last = _draws(rng, 3000, model_sd=0.03, true_sd=0.01)
    assert _coverage(paths, outcomes, 0.8) > 0.95
    assert abs(_coverage(apply_calibration(calibration, paths, last), outcomes, 0.8) - 0.8) < 0.04


def test_fit_calibration_rejects_bad_input():
    rng = np.random.default_rng(2)
    paths, outcomes, last = _draws(rng, 10)
    with pytest.raises(ValueError, match="samples \\(W, S, H\\)"):
        fit_calibration(paths[0], outcomes, last)
    paths[0, 0, 0] = -1.0
    with pytest.raises(ValueError, match="finite positive prices"):
        fit_calibration(paths, outcomes, last)


def test_fit_windows_leaves_out_every_window_with_a_close_at_or_below_zero_counts_it_and_records_the_sampling(
        caplog):
    """One rule for every caller (kronos finetune, forecast's zero-shot margins, walk-forward folds): a window whose
    sampled, realised or last close is <= 0 or not finite has no log return; it is left out, counted by series and
    said in one warning; the sampling the paths were drawn with is recorded."""
    paths, outcomes, last = _draws(np.random.default_rng(4), 10)
    names = ["a"] * 5 + ["b"] * 5
    decoding = {"T": 1.0, "top_k": 0, "top_p": 0.9, "sample_count": 200}
    fit = lambda p, o, c: fit_windows(p, o, c, names, decoding, "fold 3's calibration", "its raw bands are scored")
    with caplog.at_level(logging.WARNING):
        whole, excluded = fit(paths, outcomes, last)
    assert excluded == {} and "excluded" not in whole and not caplog.records
    assert whole == {**fit_calibration(paths, outcomes, last), "decoding": decoding}
    paths[0, 3, 1], outcomes[6, 2], last[7] = -0.5, 0.0, np.nan  # a sampled path crossed zero; a bad price; no price
    with caplog.at_level(logging.WARNING):
        cal, excluded = fit(paths, outcomes, last)
    keep = np.r_[1:6, 8:10]
    assert excluded == cal["excluded"] == {"a": 1, "b": 2} and cal["windows"] == 7 and cal["decoding"] == decoding
    assert cal["margins"] == fit_calibration(paths[keep], outcomes[keep], last[keep])["margins"] != whole["margins"]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("fold 3's calibration: 3 of 10 validation windows left out") and "a (1), b (2)" in line
    assert "raw bands" not in line
    caplog.clear()
    paths[:, 0, 0] = 0.0
    with caplog.at_level(logging.WARNING):
        assert fit(paths, outcomes, last) == (None, {"a": 5, "b": 5})
    [line] = [r.getMessage() for r in caplog.records]
    assert "10 of 10" in line and line.endswith("none is left: no calibration; its raw bands are scored")


def _folder(tmp_path, calibration):
    tok, pred = tiny_models(seed=3)
    folder = tmp_path / "best_model"
    pred.save_pretrained(folder)
    tok.save_pretrained(folder / "tokenizer")
    write_json(folder / PREDICTOR_INFO_NAME, predictor_info(folder, max_context=40, tokenizer=folder / "tokenizer"))
    write_calibration(folder / PREDICTOR_INFO_NAME, calibration)
    return folder


def test_the_predictor_applies_a_stored_calibration_to_prices_not_volume(tmp_path):
    margins = [[0.02 * (i + 1)] * 4 for i in range(10)]  # widen every band: 2% .. 20% in log return
    calibration = {"method": "conformal", "space": "log_return", "levels": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8,
                                                                             0.9, 0.95], "margins": margins,
                   "windows": 100}
    folder = _folder(tmp_path, calibration)
    info = json.loads((folder / PREDICTOR_INFO_NAME).read_text())
    assert info["calibration"] == calibration and info["max_context"] == 40 and info["tokenizer"] == "tokenizer"
    p = KronosPredictor.from_pretrained(folder, device="cpu")
    df, x_ts, y_ts = candles(30)
    runs = {}
    for calibrated in (True, False):
        torch.manual_seed(0)
        runs[calibrated] = p.predict(df, x_ts, y_ts[:4], 4, T=1.5, top_p=1.0, sample_count=20, verbose=False,
                                     quantiles=[0.1, 0.9], calibrated=calibrated)
    cal, raw = runs[True], runs[False]
    ratio = cal.samples[..., :4] / raw.samples[..., :4]  # (S, H, 4): one factor per path and horizon
    np.testing.assert_allclose(ratio, ratio[..., :1].repeat(4, axis=-1), rtol=1e-5)
    assert (np.abs(np.log(ratio)) > 0.01).mean() > 0.5  # most paths moved
    np.testing.assert_array_equal(cal.samples[..., 4:], raw.samples[..., 4:])  # volume, amount as drawn
    width = lambda fc: (fc.quantiles[0.9]["close"] - fc.quantiles[0.1]["close"]).to_numpy()
    assert (width(cal) > width(raw)).all()
    np.testing.assert_allclose(cal.mean.to_numpy(), cal.samples.mean(axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="covers 4 horizons but pred_len is 5.*calibrated=False"):
        p.predict(df, x_ts, y_ts[:5], 5, verbose=False)
    assert p.predict(df, x_ts, y_ts[:5], 5, verbose=False, calibrated=False).shape == (5, 6)


def test_a_malformed_stored_calibration_is_named(tmp_path):
    folder = _folder(tmp_path, fit_calibration(*_draws(np.random.default_rng(3), 30)))
    info = json.loads((folder / PREDICTOR_INFO_NAME).read_text())
    info["calibration"]["margins"] = [[1.0]]
    (folder / PREDICTOR_INFO_NAME).write_text(json.dumps(info))
    with pytest.raises(ValueError, match="kronos_predictor.json: not a calibration as fit_calibration writes it"):
        KronosPredictor.from_pretrained(folder, device="cpu")


@pytest.mark.parametrize("margin", [1e3, 1e6, -1e3, -1.0, float("inf")])
def test_margins_that_are_no_calibration_are_refused_at_load_naming_the_file(tmp_path, margin):
    folder = _folder(tmp_path, fit_calibration(*_draws(np.random.default_rng(3), 30)))
    info = json.loads((folder / PREDICTOR_INFO_NAME).read_text())
    info["calibration"]["margins"][3][1] = margin
    (folder / PREDICTOR_INFO_NAME).write_text(json.dumps(info))
    with pytest.raises(DataError, match=r"kronos_predictor.json: calibration margins must be finite and within "
                                        r"\[-0.9, 5\] \(band units; below -0.9 a band would collapse\); "
                                        r"margins\[3\] holds"):
        KronosPredictor.from_pretrained(folder, device="cpu")
    assert abs(np.asarray(fit_calibration(*_draws(np.random.default_rng(3), 30))["margins"])).max() < 5


def test_bands_fitted_on_one_market_cover_nominal_on_another_with_5x_the_volatility():
    # The model's spread follows each market's volatility (half the true one in both): margins in band units travel.
    rng = np.random.default_rng(4)
    calibration = fit_calibration(*_draws(rng, 400, model_sd=0.005, true_sd=0.01))
    paths, outcomes, last = _draws(rng, 2000, model_sd=0.025, true_sd=0.05)  # 5x the volatility
    calibrated = apply_calibration(calibration, paths, last)
    for level in (0.5, 0.8):
        assert _coverage(paths, outcomes, level) < level - 0.15  # raw: far too narrow
        assert abs(_coverage(calibrated, outcomes, level) - level) <= 0.10, level


def test_no_stored_calibration_collapses_a_band_to_zero_width():
    rng = np.random.default_rng(6)
    paths, _, last = _draws(rng, 50)
    old = {"method": "conformal", "space": "log_return", "levels": [0.5, 0.9], "margins": [[-5.0] * 3] * 2}
    lo, hi = np.quantile(apply_calibration(old, paths, last), [0.1, 0.9], axis=1)  # (W, H)
    raw_lo, raw_hi = np.quantile(paths, [0.1, 0.9], axis=1)
    assert ((hi - lo) >= 0.09 * (raw_hi - raw_lo)).all()  # at least 10% of the raw width is kept


@pytest.mark.slow
def test_the_tiny_model_calibrated_on_one_market_covers_nominal_on_one_with_5x_the_volatility():
    """Acceptance of issue 32 on the demo model: Kronos normalises each context, so its spread follows the
    market's volatility and margins in band units travel: 0.49 / 0.78 at nominal 0.50 / 0.80, where absolute
    log-return margins (before issue 32) covered 0.30 / 0.55 and the raw bands 0.26 / 0.48."""
    ckpt = Path(__file__).resolve().parents[1] / "checkpoints" / "demo-pretrained"
    p = KronosPredictor(Kronos.from_pretrained(ckpt / "predictor").eval(),
                        KronosTokenizer.from_pretrained(ckpt / "tokenizer").eval(), device="cpu", max_context=64)

    def market(sd, n_windows, seed):  # random-walk windows: 32 bars of context, 4 to forecast
        rng = np.random.default_rng(seed)
        close = 100 * np.exp(np.cumsum(rng.normal(0, sd, (n_windows, 36)), axis=1))  # (W, 36)
        ts = pd.Series(pd.date_range("2024-01-02 09:30", periods=36, freq="5min"))
        dfs = [pd.DataFrame({"open": c[:32], "high": c[:32] * (1 + sd / 2), "low": c[:32] * (1 - sd / 2),
                             "close": c[:32], "volume": 1e3, "amount": 1e5}) for c in close]
        torch.manual_seed(seed)
        out = p.predict_batch(dfs, [ts[:32]] * n_windows, [ts[32:]] * n_windows, 4, T=1.0, top_p=1.0,
                              sample_count=16, verbose=False, return_samples=True, calibrated=False)
        return np.stack([f.samples[..., 3] for f in out]), close[:, 32:], close[:, 31]  # (W, S, 4), (W, 4), (W,)

    calibration = fit_calibration(*market(0.002, 150, 1))
    paths, outcomes, last = market(0.01, 200, 2)
    calibrated = apply_calibration(calibration, paths, last)
    for level in (0.5, 0.8):
        assert abs(_coverage(calibrated, outcomes, level) - level) <= 0.10, (level, _coverage(paths, outcomes, level))
