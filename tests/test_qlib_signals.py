"""finetune/qlib_test.py without models: test windows, forecast dates, signals, realised returns, IC, period."""

import numpy as np
import pandas as pd
import pytest

from finetune import qlib_io as qio
from finetune import qlib_test as qt
from finetune.utils.panel import SeriesPanel

LOOKBACK = 4


def split_with(closes: dict[str, np.ndarray], first_day: str = "2021-03-01") -> SeriesPanel:
    feats, when = [], []
    for c in closes.values():
        f = np.ones((len(c), 6), dtype=np.float32)
        f[:, 3] = c
        feats.append(f)
        when.append(qio.datetimes_ns(pd.bdate_range(first_day, periods=len(c))))
    when = np.concatenate(when)
    lengths = [len(c) for c in closes.values()]
    return SeriesPanel(np.ascontiguousarray(np.concatenate(feats).T), qio.stamps_from_ns(when),
                       np.r_[0, np.cumsum(lengths)].astype(np.int64), list(closes), when)


def test_forecast_window_ends_need_a_full_context_and_a_date_in_range():
    split = split_with({"A": np.arange(1.0, 11.0), "B": np.arange(1.0, 4.0)})  # B has 3 bars < LOOKBACK
    days = pd.bdate_range("2021-03-01", periods=10)
    start, end = qio.range_bounds([str(days[2].date()), str(days[8].date())])
    ends = qt.forecast_window_ends(split, start.value, end.value, LOOKBACK)
    # A: bars 3..8 (bar 3 is the first with 4 bars of context; bar 9 is after the range); B: none
    assert ends.tolist() == [3, 4, 5, 6, 7, 8]
    rows = qt.context_rows(ends, LOOKBACK)
    assert rows[0].tolist() == [0, 1, 2, 3] and rows[-1].tolist() == [5, 6, 7, 8]


def test_forecast_dates_follow_the_calendar_then_business_days():
    cal = pd.bdate_range("2021-03-01", periods=5)  # Mon 1 .. Fri 5 March
    cal_ns = qio.datetimes_ns(cal)
    out = qt.forecast_dates(cal_ns, cal_ns[[1, 4]], 3, "day")
    got = [[str(pd.Timestamp(int(v)).date()) for v in row] for row in out]
    assert got[0] == ["2021-03-03", "2021-03-04", "2021-03-05"]
    assert got[1] == ["2021-03-08", "2021-03-09", "2021-03-10"]  # past the calendar: next business days


def test_signals_are_predicted_returns_against_the_last_close():
    pred = np.array([[11.0, 12.0, 9.0], [20.0, 20.0, 20.0]])
    last = np.array([10.0, 25.0])
    s = qt.signals_from_closes(pred, last)
    np.testing.assert_allclose(s["last"], [-0.1, -0.2])
    np.testing.assert_allclose(s["mean"], [32 / 30 - 1, -0.2])
    np.testing.assert_allclose(s["max"], [0.2, -0.2])
    np.testing.assert_allclose(s["min"], [-0.1, -0.2])


def test_realised_returns_stop_at_the_end_of_each_instrument():
    split = split_with({"A": np.array([10.0, 11.0, 12.1, 13.0]), "B": np.array([5.0, 6.0, 3.0])})
    ends = np.array([0, 1, 3, 4, 5, 6])
    r = qt.realised_returns(split, ends, 1)
    np.testing.assert_allclose(r[:2], [0.1, 0.1], rtol=1e-6)
    assert np.isnan(r[2])  # A's last bar: B's first bar must not be used
    np.testing.assert_allclose(r[3:5], [0.2, -0.5], rtol=1e-6)
    assert np.isnan(r[5])


def test_daily_ic_matches_pandas_pearson_and_spearman():
    rng = np.random.default_rng(0)
    days = np.repeat(pd.bdate_range("2021-01-04", periods=6), 8)
    frame = pd.DataFrame({"datetime": days, "mean": rng.normal(size=48), "label": rng.normal(size=48)})
    frame.loc[3, "label"] = np.nan  # rows without a realised return are left out
    daily = qt.daily_ic(frame, ["mean"])
    valid = frame.dropna()
    for day, group in valid.groupby("datetime"):
        assert daily.loc[day, "mean_ic"] == pytest.approx(group["mean"].corr(group["label"]), abs=1e-9)
        assert daily.loc[day, "mean_rank_ic"] == pytest.approx(group["mean"].corr(group["label"], method="spearman"), abs=1e-9)
    summary = qt.summarize_ic(daily, ["mean"])["mean"]
    assert summary["IC"] == pytest.approx(daily["mean_ic"].mean())
    assert summary["ICIR"] == pytest.approx(daily["mean_ic"].mean() / daily["mean_ic"].std())
    assert summary["days"] == 6


def test_daily_ic_is_nan_for_a_constant_or_single_stock_day():
    frame = pd.DataFrame({"datetime": pd.to_datetime(["2021-01-04"] * 3 + ["2021-01-05"]),
                          "mean": [1.0, 1.0, 1.0, 2.0], "label": [0.1, 0.2, 0.3, 0.1]})
    daily = qt.daily_ic(frame, ["mean"])
    assert daily["mean_ic"].isna().all() and daily["mean_rank_ic"].isna().all()


def test_backtest_period_stops_before_the_calendars_last_day():
    cal = pd.bdate_range("2021-03-01", periods=10)
    start, end = qio.range_bounds(["2021-03-02", "2021-12-31"])
    assert qt.backtest_period(cal, start, end) == (cal[1], cal[-2])
    with pytest.raises(ValueError, match="data.test_time_range"):
        qt.backtest_period(cal, *qio.range_bounds(["2021-03-12", "2021-03-31"]))
