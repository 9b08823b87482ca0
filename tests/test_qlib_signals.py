"""finetune/qlib_forecast.py and qlib_report.py without models: test windows, forecast dates, signals, calendar labels,
the backtest period."""

import numpy as np
import pandas as pd
import pytest

from finetune import qlib_forecast as qt
from finetune import qlib_io as qio
from finetune import qlib_test as qr
from finetune.utils.store import SeriesPanel
from finetune.utils.windows import wallclock_stamps

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
    return SeriesPanel(np.ascontiguousarray(np.concatenate(feats).T), wallclock_stamps(when),
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


def test_panel_labels_follow_the_trade_on_the_market_calendar():
    # A trades every day; B misses 2021-03-04 (suspended): a label needing that day is NaN, never a longer return
    cal = pd.bdate_range("2021-03-01", periods=6)
    a_close = np.array([10.0, 11.0, 12.1, 13.0, 14.3, 15.0])
    feats, when = [], []
    for c, days in ((a_close, cal), (np.array([5.0, 6.0, 3.0, 4.0, 8.0]), cal.delete(3))):
        f = np.ones((len(c), 6), dtype=np.float32)
        f[:, 3] = c
        feats.append(f)
        when.append(qio.datetimes_ns(days))
    w = np.concatenate(when)
    split = SeriesPanel(np.ascontiguousarray(np.concatenate(feats).T), wallclock_stamps(w),
                        np.array([0, 6, 11]), ["A", "B"], w)
    ends = np.arange(11)
    h1 = qt.panel_labels(split, ends, qio.datetimes_ns(cal), 1)
    # A: close(t+2) / close(t+1) - 1; the last two days have no t+2 in the calendar
    np.testing.assert_allclose(h1[:4], a_close[2:6] / a_close[1:5] - 1, rtol=1e-6)
    assert np.isnan(h1[4:6]).all()
    # B (rows 6..10 = Mar 1, 2, 3, 5, 8): Mar 1 -> 3/6 - 1; Mar 2 and 3 need Mar 4 -> NaN; Mar 5 -> needs Mar 9 -> NaN
    np.testing.assert_allclose(h1[6], 3.0 / 6.0 - 1, rtol=1e-6)
    assert np.isnan(h1[7:11]).all()
    h2 = qt.panel_labels(split, ends[:1], qio.datetimes_ns(cal), 2)
    np.testing.assert_allclose(h2, [13.0 / 11.0 - 1], rtol=1e-6)


def test_signal_horizons():
    assert [qt.signal_horizon(s, 10) for s in ("last", "mean", "max", "min", "momentum")] == [10, 5, 10, 10, 1]


def test_backtest_period_stops_before_the_calendars_last_day():
    cal = pd.bdate_range("2021-03-01", periods=10)
    start, end = qio.range_bounds(["2021-03-02", "2021-12-31"])
    assert qr.backtest_period(cal, start, end) == (cal[1], cal[-2])
    with pytest.raises(ValueError, match="data.test_time_range"):
        qr.backtest_period(cal, *qio.range_bounds(["2021-03-12", "2021-03-31"]))
