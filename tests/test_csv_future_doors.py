"""`kronos forecast --future` and `predict_df` (issue 38): the same relative bands for a tiny-priced series and the
same series x1e6, and the same numbers from both doors with the forecast settings' sampling defaults."""
import numpy as np
import pandas as pd
import pytest

from finetune_csv import forecast
from finetune_csv.config import load
from tests.test_csv_eval import make_run

QS = ("10", "50", "90")


def rescale(path, factor: float) -> None:
    frame = pd.read_csv(path)
    prices = [c for c in frame.columns if c.lower() in ("open", "high", "low", "close", "amount")]
    frame[prices] *= factor
    frame.to_csv(path, index=False)


def relative(table: pd.DataFrame, data) -> np.ndarray:
    """(series, steps, 3): the close quantiles / each series' last close."""
    out = []
    for name, part in table.groupby("series", sort=True):
        last = pd.read_csv(data / name)["close"].iloc[-1]
        out.append(part[[f"close_q{q}" for q in QS]].to_numpy() / last)
    return np.stack(out)


@pytest.mark.slow
def test_future_forecasts_agree_across_price_units_and_with_predict_df(tmp_path):
    cfg = load(make_run(tmp_path, zero_shot=None, extra="sample_count: 40, calibrate: false"))
    data = tmp_path / "data"
    tiny = sorted(data.glob("*.csv"))[0]
    rescale(tiny, 3e-7)  # ~3e-5: an altcoin quoted in BTC
    first = relative(forecast.run_future(cfg), data)
    rescale(tiny, 1e6)
    second = forecast.run_future(cfg)
    np.testing.assert_allclose(relative(second, data), first, rtol=0.01)

    frame = pd.concat([pd.read_csv(f).assign(id=f.name) for f in sorted(data.glob("*.csv"))])
    predictor, _ = forecast.finetuned_predictor(cfg)
    f = cfg.forecast
    long = predictor.predict_df(frame, prediction_length=cfg.data.predict, quantiles=[0.1, 0.5, 0.9],
                                sample_count=f.sample_count, seed=f.seed, batch_size=f.batch_size)
    assert list(long["timestamps"].astype(str)) == list(second["timestamps"].astype(str))
    for q in QS:
        np.testing.assert_allclose(long[f"close_q{q}"], second[f"close_q{q}"], rtol=1e-5)


@pytest.mark.parametrize("zone", [None, "UTC", "America/New_York", "Asia/Shanghai"])
def test_future_stamps_keep_the_input_time_zone(tmp_path, zone):
    """Naive stamps in -> naive out; UTC offsets in -> aware out, in data.timezone when set (as predict_df); other
    offsets without data.timezone name no zone: naive out (their wall clock, as read)."""
    cfg = load(make_run(tmp_path, zero_shot=None, extra="sample_count: 2"))
    for path in (tmp_path / "data").glob("*.csv"):
        frame = pd.read_csv(path)
        frame["timestamps"] = pd.to_datetime(frame["timestamps"]).dt.tz_localize("UTC" if zone else None)
        if zone == "Asia/Shanghai":
            frame["timestamps"] = frame["timestamps"].dt.tz_convert(zone)  # "+08:00"
        frame.to_csv(path, index=False)  # "2024-01-02 09:30:00+00:00" with a zone
    if zone == "America/New_York":
        cfg.data.timezone = zone
    table = forecast.run_future(cfg)
    last = pd.read_csv(sorted((tmp_path / "data").glob("*.csv"))[0])["timestamps"].iloc[-1]
    out = None if zone == "Asia/Shanghai" else zone
    assert str(table["timestamps"].dt.tz) == str(out) and (str(last)[-6:] in ("+00:00", "+08:00")) == bool(zone)
    first = table[table["series"] == table["series"].iloc[0]]["timestamps"].iloc[0]
    if out or not zone:
        assert pd.Timedelta(0) < first - pd.Timestamp(last) < pd.Timedelta(days=4)  # after the last bar
    written = pd.read_csv(cfg.base_dir / "future" / "forecast.csv")["timestamps"]
    assert written.str.endswith(("+00:00", "-05:00", "-04:00")).all() == bool(out)
