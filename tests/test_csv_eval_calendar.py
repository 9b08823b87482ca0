"""Future bar timestamps (finetune_csv.forecast): daily, intraday sessions with a lunch break, a calendar."""

from __future__ import annotations

import pandas as pd
import pytest

from finetune_csv.forecast import future_timestamps, read_calendar


def session_bars(days: pd.DatetimeIndex) -> pd.DatetimeIndex:
    """30-minute bars 09:30-11:00 and 13:00-14:30 (bar start times) on each day."""
    times = ["09:30", "10:00", "10:30", "11:00", "13:00", "13:30", "14:00", "14:30"]
    return pd.DatetimeIndex([d + pd.Timedelta(f"{t}:00") for d in days for t in times])


def test_daily_bars_continue_on_the_next_weekdays():
    history = pd.bdate_range("2024-03-04", "2024-03-15")  # ends on a Friday
    got = future_timestamps(history, 3)
    assert list(got) == list(pd.DatetimeIndex(["2024-03-18", "2024-03-19", "2024-03-20"]))


def test_daily_bars_of_a_market_open_every_day_continue_daily():
    history = pd.date_range("2024-03-01", "2024-03-10", freq="D")  # includes weekends (crypto)
    assert list(future_timestamps(history, 2)) == list(pd.DatetimeIndex(["2024-03-11", "2024-03-12"]))


def test_intraday_bars_follow_the_session_and_skip_lunch_and_the_weekend():
    history = session_bars(pd.bdate_range("2024-03-04", "2024-03-15"))[:-4]  # Friday ends at 11:00
    got = future_timestamps(history, 8)
    expected = ["2024-03-15 13:00", "2024-03-15 13:30", "2024-03-15 14:00", "2024-03-15 14:30",
                "2024-03-18 09:30", "2024-03-18 10:00", "2024-03-18 10:30", "2024-03-18 11:00"]
    assert list(got) == list(pd.DatetimeIndex(expected))


def test_a_calendar_skips_a_holiday(tmp_path):
    cal = tmp_path / "sessions.csv"
    pd.DataFrame({"date": ["2024-03-15", "2024-03-19", "2024-03-20"]}).to_csv(cal, index=False)  # 18th: holiday
    history = session_bars(pd.bdate_range("2024-03-04", "2024-03-15"))
    got = future_timestamps(history, 9, read_calendar(cal))
    assert got[0] == pd.Timestamp("2024-03-19 09:30") and got[-1] == pd.Timestamp("2024-03-20 09:30")
    with pytest.raises(ValueError, match="extend the calendar"):
        future_timestamps(history, 30, read_calendar(cal))


def test_a_calendar_that_is_not_dates_is_a_clear_error(tmp_path):
    cal = tmp_path / "bad.csv"
    pd.DataFrame({"date": ["monday", "tuesday"]}).to_csv(cal, index=False)
    with pytest.raises(ValueError, match="forecast.calendar"):
        read_calendar(cal)
