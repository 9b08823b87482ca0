"""Trading calendars (model.calendar): the bars after a series' end occur at times its market trades."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest

from model.calendar import TradingCalendar
from model.errors import DataError


def fx_hours(start: str, end: str) -> pd.DatetimeIndex:
    """Hourly FX bars (24/5): Sunday 21:00 to Friday 20:00 (the last bar closes at 21:00), no Saturday."""
    h = pd.date_range(start, end, freq="h")
    closed = (h.day_of_week == 5) | ((h.day_of_week == 6) & (h.hour < 21)) | ((h.day_of_week == 4) & (h.hour > 20))
    return h[~closed]


def session_bars(days: pd.DatetimeIndex) -> pd.DatetimeIndex:
    """30-minute bars 09:30-11:00 and 13:00-14:30 (bar start times) on each day."""
    times = ["09:30", "10:00", "10:30", "11:00", "13:00", "13:30", "14:00", "14:30"]
    return pd.DatetimeIndex([d + pd.Timedelta(f"{t}:00") for d in days for t in times])


def weekly_slots(stamps: pd.DatetimeIndex) -> set[tuple[int, int]]:
    return set(zip(stamps.day_of_week, stamps.hour * 60 + stamps.minute))


def test_fx_hours_ending_on_a_friday_continue_on_sunday_evening():
    history = fx_hours("2024-01-07 21:00", "2024-03-01 16:00")  # ends Friday 16:00
    got = TradingCalendar.learn(history).after(history[-1], 24)
    assert weekly_slots(got) <= weekly_slots(history)  # every stamp is an hour the market trades
    assert list(got[:5]) == list(pd.DatetimeIndex(["2024-03-01 17:00", "2024-03-01 18:00", "2024-03-01 19:00",
                                                   "2024-03-01 20:00", "2024-03-03 21:00"]))
    assert got[-1] == pd.Timestamp("2024-03-04 16:00") and got.is_monotonic_increasing


def test_a_forced_freq_keeps_only_the_hours_the_market_trades():
    history = fx_hours("2024-01-07 21:00", "2024-03-01 16:00")
    cal = TradingCalendar.learn(history)
    assert list(cal.after(history[-1], 24, freq="h")) == list(cal.after(history[-1], 24))
    half = cal.after(history[-1], 10, freq="30min")  # finer than the bars: both halves of each traded hour
    assert list(half[-2:]) == [pd.Timestamp("2024-03-01 20:30"), pd.Timestamp("2024-03-03 21:00")]
    with pytest.raises(DataError, match="freq 'nonsense' is not a pandas frequency"):
        cal.after(history[-1], 3, freq="nonsense")


def test_crypto_hours_trade_every_hour_of_every_day():
    history = pd.date_range("2024-01-01", "2024-02-02 23:00", freq="h")  # ends Friday 23:00
    got = TradingCalendar.learn(history).after(history[-1], 30)
    assert list(got) == list(pd.date_range("2024-02-03", periods=30, freq="h"))  # Saturday included


def test_daily_stock_bars_continue_on_business_days_and_crypto_every_day():
    days = pd.bdate_range("2023-06-01", "2024-03-15")  # ends on a Friday
    holidays = pd.DatetimeIndex(["2023-07-04", "2023-09-04", "2023-11-23", "2023-12-25", "2024-01-01"])
    stock = days.difference(holidays).append(pd.DatetimeIndex(["2023-09-09"])).sort_values()  # one stray Saturday
    got = TradingCalendar.learn(stock).after(stock[-1], 6)
    assert list(got) == list(pd.bdate_range("2024-03-18", periods=6))
    crypto = pd.date_range("2024-03-01", "2024-03-10", freq="D")
    assert list(TradingCalendar.learn(crypto).after(crypto[-1], 2)) == list(pd.date_range("2024-03-11", periods=2))
    assert list(TradingCalendar.learn(stock).after(stock[-1], 3, freq="D")) == list(pd.bdate_range("2024-03-18",
                                                                                                  periods=3))


def test_intraday_session_with_lunch_break_and_per_weekday_times():
    days = pd.bdate_range("2024-02-05", "2024-03-15")
    bars = session_bars(days)
    bars = bars[~((bars.day_of_week == 4) & (bars.hour >= 13))]  # Fridays: a half day
    history = bars[:-1]  # ends Friday 10:30
    got = TradingCalendar.learn(history).after(history[-1], 10)
    expected = ["2024-03-15 11:00", "2024-03-18 09:30", "2024-03-18 10:00", "2024-03-18 10:30", "2024-03-18 11:00",
                "2024-03-18 13:00", "2024-03-18 13:30", "2024-03-18 14:00", "2024-03-18 14:30", "2024-03-19 09:30"]
    assert list(got) == list(pd.DatetimeIndex(expected))


def test_a_calendar_of_trading_dates_skips_a_holiday():
    history = session_bars(pd.bdate_range("2024-03-04", "2024-03-15"))
    cal = TradingCalendar.learn(history, dates=pd.to_datetime(["2024-03-15", "2024-03-19", "2024-03-20"]))
    got = cal.after(history[-1], 9)
    assert got[0] == pd.Timestamp("2024-03-19 09:30") and got[-1] == pd.Timestamp("2024-03-20 09:30")
    with pytest.raises(DataError, match="end on 2024-03-20.*extend the calendar"):
        cal.after(history[-1], 30)


def test_monthly_bars_follow_their_pandas_frequency():
    history = pd.date_range("2020-01-31", periods=20, freq="ME")
    got = TradingCalendar.learn(history).after(history[-1], 3)
    assert list(got) == list(pd.DatetimeIndex(["2021-09-30", "2021-10-31", "2021-11-30"]))


def test_tz_aware_stamps_are_read_on_their_own_wall_clock():
    wall = fx_hours("2024-01-07 21:00", "2024-03-01 16:00")
    history = wall.tz_localize("Asia/Shanghai")
    got = TradingCalendar.learn(history).after(history[-1], 24)
    assert str(got.tz) == "Asia/Shanghai"
    assert list(got.tz_localize(None)) == list(TradingCalendar.learn(wall).after(wall[-1], 24))
    with pytest.raises(DataError, match="not both tz-aware or both naive"):
        TradingCalendar.learn(history).after(wall[-1], 3)


def test_a_dst_change_never_stamps_a_time_twice_or_one_that_does_not_exist():
    history = pd.date_range("2024-03-01", periods=24 * 30, freq="h", tz="Europe/Berlin")
    got = TradingCalendar.learn(history).after(history[-1], 4)  # 2024-03-31 02:00 does not exist in Berlin
    assert got.is_unique and got.is_monotonic_increasing
    assert list(got.hour) == [0, 1, 3, 4]


def test_histories_that_define_no_calendar_are_clear_errors():
    with pytest.raises(DataError, match="1 row\\(s\\): too few to learn its trading calendar; pass freq="):
        TradingCalendar.learn(pd.DatetimeIndex(["2024-01-02"]))
    rng = np.random.default_rng(0)
    scattered = pd.DatetimeIndex(sorted(pd.Timestamp("2024-01-01") + pd.to_timedelta(rng.integers(0, 40 * 86400, 60),
                                                                                      unit="s")))
    with pytest.raises(DataError, match="no time of day recurs"):
        TradingCalendar.learn(scattered)


# ------------------------------------------------------------------------------ predict_df stamps by the calendar
def _long(stamps_by_id: dict[str, pd.DatetimeIndex]) -> pd.DataFrame:
    from tests.test_model_predictor import candles

    parts = []
    for k, (sid, stamps) in enumerate(stamps_by_id.items()):
        df = candles(len(stamps), seed=k)[0].rename(columns=str.title)  # Open/High/...: any case is read
        parts.append(df.assign(Date=stamps, id=sid))
    return pd.concat(parts, ignore_index=True)


@pytest.fixture(scope="module")
def predictor():
    from model import KronosPredictor
    from tests.model_factory import tiny_models

    tok, pred = tiny_models(seed=1)
    return KronosPredictor(pred, tok, device="cpu", max_context=64)


def test_predict_df_stamps_fx_hours_and_stock_business_days_without_freq(predictor):
    fx = fx_hours("2024-02-04 21:00", "2024-03-01 16:00")[-200:]
    stock = pd.bdate_range("2023-10-02", "2024-03-15")[-60:]
    out = predictor.predict_df(_long({"EURUSD": fx, "STOCK": stock}), prediction_length=6, top_k=1, sample_count=1)
    got = {sid: pd.DatetimeIndex(part["Date"]) for sid, part in out.groupby("id")}
    assert weekly_slots(got["EURUSD"]) <= weekly_slots(fx) and got["EURUSD"][4] == pd.Timestamp("2024-03-03 21:00")
    assert list(got["STOCK"]) == list(pd.bdate_range("2024-03-18", periods=6))
    forced = predictor.predict_df(_long({"EURUSD": fx}), prediction_length=6, freq="h", top_k=1, sample_count=1)
    assert not (pd.DatetimeIndex(forced["Date"]).day_of_week == 5).any()  # no Saturday hour


def test_predict_df_takes_your_calendar_or_your_timestamps(predictor):
    stock = pd.bdate_range("2024-01-02", "2024-03-15")
    frame = _long({"A": stock, "B": stock})
    crypto = TradingCalendar.learn(pd.date_range("2024-01-01", periods=30, freq="D"))
    out = predictor.predict_df(frame, prediction_length=3, calendar=crypto, top_k=1, sample_count=1)
    assert list(out["Date"][:3]) == list(pd.date_range("2024-03-16", periods=3))  # Saturday: your calendar
    mine = pd.to_datetime(["2024-03-18", "2024-03-20", "2024-03-22"])
    out = predictor.predict_df(frame, prediction_length=3, future={"A": mine, "B": mine + pd.Timedelta("1D")},
                               top_k=1, sample_count=1)
    assert list(out["Date"]) == [*mine, *(mine + pd.Timedelta("1D"))]
    with pytest.raises(DataError, match="future has no timestamps for series 'B'"):
        predictor.predict_df(frame, prediction_length=3, future={"A": mine}, top_k=1)
    with pytest.raises(DataError, match="series 'A': the history's timestamps are naive but the forecast's are "
                                        "tz-aware"):
        predictor.predict_df(frame, prediction_length=3, future=mine.tz_localize("UTC"), top_k=1)


@pytest.mark.parametrize("change, message", [
    (lambda f: f.assign(Close=np.where(f.index == 70, np.nan, f.Close)),
     r"series 'B' has 1 value\(s\) NaN/inf, first in column 'close' at row 20 \(2024-01-30"),
    (lambda f: f.assign(Low=np.where(f.index == 55, -1.0, f.Low)),
     r"series 'B': column 'low' is <= 0 .* first at row 5 \(2024-01-09"),
    (lambda f: f.drop(columns="High"), r"no 'high' column, in any case; columns: \['Open', 'Low'"),
])
def test_predict_df_messages_name_the_series_and_the_bar(predictor, change, message):
    stock = pd.bdate_range("2024-01-02", periods=50)
    with pytest.raises(DataError, match=message):
        predictor.predict_df(change(_long({"A": stock, "B": stock})), prediction_length=3, top_k=1)


@pytest.mark.parametrize("n, message", [(-1, "prediction_length must be an integer >= 1, got -1"),
                                        (65, r"prediction_length=65 is more than the predictor's window")])
def test_predict_df_refuses_a_prediction_length_it_cannot_make(predictor, n, message):
    with pytest.raises(DataError, match=message):
        predictor.predict_df(_long({"A": pd.bdate_range("2024-01-02", periods=50)}), prediction_length=n)


def test_the_same_instants_in_utc_and_shanghai_are_read_on_their_own_clocks(predictor):
    stock = pd.bdate_range("2024-01-02 01:30", periods=40, freq="B")
    utc = _long({"A": stock.tz_localize("UTC")})
    local = utc.assign(Date=utc["Date"].dt.tz_convert("Asia/Shanghai"))  # the same instants
    a = predictor.predict_df(utc, prediction_length=3, top_k=1, sample_count=1)
    b = predictor.predict_df(local, prediction_length=3, top_k=1, sample_count=1)
    assert str(b["Date"].dt.tz) == "Asia/Shanghai" and (a["Date"] == b["Date"]).all()  # same instants stamped
    assert not np.allclose(a["close"], b["close"])  # different clock-time features: different forecasts, by design
    mixed = pd.concat([utc.assign(id="U"), local.assign(id="S")], ignore_index=True)
    with pytest.raises(DataError, match="column 'Date' holds values that are not datetimes"):  # two zones in one column
        predictor.predict_df(mixed, prediction_length=3)


def test_thanksgiving_is_skipped_with_a_holiday_calendar_or_said_not_to_be(predictor):
    pytest.importorskip("holidays")
    from model.calendar import HolidaysNotSkipped

    days = pd.bdate_range(end="2019-11-27", periods=60)  # daily US history ending the day before Thanksgiving
    frame = pd.DataFrame({"Date": days, "Open": 100.0, "High": 101.0, "Low": 99.0, "Close": 100.0})
    with pytest.warns(HolidaysNotSkipped, match="holidays included.*holidays='NYSE'"):
        plain = predictor.predict_df(frame, prediction_length=2, top_k=1)
    assert list(plain["Date"]) == [pd.Timestamp("2019-11-28"), pd.Timestamp("2019-11-29")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", HolidaysNotSkipped)
        named = predictor.predict_df(frame, prediction_length=2, top_k=1, holidays="NYSE")
    assert list(named["Date"]) == [pd.Timestamp("2019-11-29"), pd.Timestamp("2019-12-02")]
    with pytest.raises(DataError, match="neither a market.*nor a country"):
        predictor.predict_df(frame, prediction_length=2, top_k=1, holidays="Atlantis")


# ------------------------------------------------------------------- minute sessions cut mid-session (issue 48)
def minute_bars(days: pd.DatetimeIndex, market: str) -> pd.DatetimeIndex:
    """One-minute bar starts of a market on `days`: 'spy' 09:30-15:59, 'fx' around the clock, 'es' around the clock
    but a daily halt 20:15-20:29 and a break 21:15-21:59 (UTC, futures-like)."""
    minutes = pd.timedelta_range(0, periods=24 * 60, freq="min")
    keep = {"spy": (minutes >= "9h30min") & (minutes < "16h"), "fx": np.ones(len(minutes), bool),
            "es": ~(((minutes >= "20h15min") & (minutes < "20h30min")) | ((minutes >= "21h15min") & (minutes < "22h")))}
    return pd.DatetimeIndex([d + m for d in days for m in minutes[keep[market]]])


def no_trade(bars: pd.DatetimeIndex) -> pd.DatetimeIndex:
    """The bars less the minutes with no trade: a ninth of each day's minutes, a different ninth on each day."""
    day = (bars.normalize() - bars[0].normalize()).days
    return bars[(bars.hour * 60 + bars.minute) % 9 != day % 9]


@pytest.mark.parametrize("market, cut", [("spy", "2024-03-14 15:30"), ("fx", "2024-03-13 12:00"),
                                         ("es", "2024-03-14 21:14"), ("es", "2024-03-14 20:10")])
@pytest.mark.parametrize("days", [3, 63])
def test_a_context_cut_mid_session_continues_that_session_at_every_minute(market, cut, days):
    cut = pd.Timestamp(cut)
    history = no_trade(minute_bars(pd.bdate_range(end=cut.normalize(), periods=days), market))
    history = history[history <= cut]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = TradingCalendar.learn(history).after(cut, 120)
    expected = minute_bars(pd.bdate_range(cut.normalize(), periods=3), market)  # the market's own next minutes
    assert list(got) == list(expected[expected > cut][:120])
    short = [str(w.message) for w in said if "no whole session" in str(w.message)]
    assert len(short) == (days == 3)
    assert days == 63 or "3 day(s) of recent history hold no whole session of Monday, " in short[0]
