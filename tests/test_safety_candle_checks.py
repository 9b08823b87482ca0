"""Candle checks: DST offsets parse to local wall-clock time, tz/frequency mixes are named, float32 overflow caught."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from finetune_csv.sources import Float32RangeError, check_float32_range
from finetune_csv.timestamps import (
    CandleDataError,
    FrequencyError,
    MixedFrequencyWarning,
    TimestampError,
    TimezoneMixError,
    check_frequencies,
    check_tz_consistency,
    format_frequency,
    infer_frequency,
    parse_timestamps,
)
from tests.csv_reference import has_utc_offset

# New York opens at 09:30 local time; DST ends on 2024-11-03, so the offset changes inside the file.
DST = ["2024-11-01 09:30:00-04:00", "2024-11-01 09:35:00-04:00", "2024-11-04 09:30:00-05:00",
       "2024-11-04 09:35:00-05:00"]
LOCAL = pd.DatetimeIndex(["2024-11-01 09:30", "2024-11-01 09:35", "2024-11-04 09:30", "2024-11-04 09:35"])


def test_offsets_across_a_dst_change_keep_the_stated_wall_clock_time():
    idx = parse_timestamps(DST, source="spy.csv")
    assert idx.dtype == "datetime64[ns]" and idx.tz is None
    assert idx.equals(LOCAL)
    assert list(idx.hour) == [9, 9, 9, 9] and list(idx.minute) == [30, 35, 30, 35]


def test_offsets_are_converted_to_data_timezone_when_set():
    assert parse_timestamps(DST, source="spy.csv", timezone="America/New_York").equals(LOCAL)
    utc = ["2024-11-01T13:30:00Z", "2024-11-04T14:30:00Z"]  # the same two opens, stated in UTC
    idx = parse_timestamps(utc, source="spy.csv", timezone="America/New_York")
    assert list(idx) == [pd.Timestamp("2024-11-01 09:30"), pd.Timestamp("2024-11-04 09:30")]
    shanghai = parse_timestamps(["2024-01-02 01:30:00+00:00", "2024-01-02 02:30:00+0000"], source="a.csv",
                                timezone="Asia/Shanghai")
    assert list(shanghai.hour) == [9, 10]
    with pytest.raises(TimestampError, match="data.timezone: unknown time zone 'Mars/Olympus'"):
        parse_timestamps(DST, source="spy.csv", timezone="Mars/Olympus")


def test_naive_stamps_are_kept_and_dates_are_not_mistaken_for_offsets():
    dates = parse_timestamps(["2024-01-02", "2024-01-03"], source="d.csv", timezone="America/New_York")
    assert list(dates) == [pd.Timestamp("2024-01-02"), pd.Timestamp("2024-01-03")]
    assert not has_utc_offset(["2024-01-02", "2024-01-03 09:30"]) and has_utc_offset(DST)
    fmt = parse_timestamps(["2024/01/02 09:30", "2024/01/02 09:35"], source="d.csv", fmt="%Y/%m/%d %H:%M")
    assert list(fmt.minute) == [30, 35]


def test_datetime_inputs():
    aware = pd.DatetimeIndex(["2024-01-02 01:30"]).tz_localize("UTC")
    assert has_utc_offset(aware) and not has_utc_offset(pd.DatetimeIndex(["2024-01-02"]))
    assert list(parse_timestamps(aware, source="x", timezone="Asia/Shanghai").hour) == [9]
    assert list(parse_timestamps(aware, source="x").hour) == [1]


def test_mixed_offsets_within_a_file_and_bad_values_name_the_lines():
    with pytest.raises(TimestampError) as info:
        parse_timestamps(["2024-11-01 09:30:00-04:00", "2024-11-01 09:35:00"], source="a.csv", first_row=2)
    assert str(info.value).startswith("a.csv: some timestamps carry a UTC offset (line(s) 2, e.g. "
                                      "'2024-11-01 09:30:00-04:00') and some do not (line(s) 3")
    with pytest.raises(TimestampError, match=r"a.csv: cannot read timestamp\(s\) at line\(s\) 4, e.g. 'soon' .*"
                                             "set data.timestamp_format"):
        parse_timestamps(["2024-01-02 09:30", "2024-01-02 09:35", "soon"], source="a.csv", first_row=2)
    with pytest.raises(TimestampError, match=r"a.csv: empty timestamp at line\(s\) 3"):
        parse_timestamps(["2024-01-02 09:30", None], source="a.csv", first_row=2)
    assert issubclass(TimestampError, CandleDataError) and issubclass(CandleDataError, ValueError)


def test_tz_consistency_names_both_kinds_of_files():
    check_tz_consistency({"a.csv": True, "b.csv": True})
    check_tz_consistency({"a.csv": False})
    with pytest.raises(TimezoneMixError) as info:
        check_tz_consistency({"a.csv": True, "b.csv": False, "c.csv": True})
    msg = str(info.value)
    assert "2 file(s) have timestamps with a UTC offset (a.csv, c.csv) and 1 without (b.csv)" in msg
    assert "data.timezone" in msg


def test_infer_frequency_is_robust_to_session_and_weekend_gaps():
    days = [pd.date_range(f"2024-01-0{d} 09:30", periods=78, freq="5min") for d in (2, 3, 4, 5, 8)]
    intraday = pd.DatetimeIndex(np.concatenate([d.values for d in days]))
    assert infer_frequency(intraday) == pd.Timedelta("5min")
    daily = pd.bdate_range("2024-01-01", periods=60)  # weekends missing
    assert infer_frequency(daily[::-1]) == pd.Timedelta("1D")  # order does not matter
    with pytest.raises(FrequencyError, match="one.csv: needs at least two distinct timestamps"):
        infer_frequency(pd.DatetimeIndex(["2024-01-02", "2024-01-02"]), source="one.csv")


def test_check_frequencies_warns_naming_odd_files_and_errors_with_data_frequency():
    five, day = pd.Timedelta("5min"), pd.Timedelta("1D")
    assert check_frequencies({"a.csv": five, "b.csv": five}) == five
    with pytest.warns(MixedFrequencyWarning) as rec:
        assert check_frequencies({"a.csv": five, "b.csv": five, "c.csv": day}) == five
    assert "most are 5min (2 file(s)), the others: 1 day: c.csv" in str(rec[0].message)
    assert check_frequencies({"a.csv": five}, expected="5min") == five
    with pytest.raises(FrequencyError) as info:
        check_frequencies({"a.csv": five, "c.csv": day}, expected="5min")
    assert str(info.value).startswith("data.frequency is 5min but 1 file(s) have another bar length: c.csv (1 day)")
    with pytest.raises(FrequencyError, match="data.frequency: cannot read 'often'"):
        check_frequencies({"a.csv": five}, expected="often")
    assert check_frequencies({}) is None
    assert [format_frequency(pd.Timedelta(x)) for x in ("1h", "2D", "30s", "90min")] == ["1h", "2 days", "30s",
                                                                                       "90min"]


def test_float32_range_names_file_column_and_line():
    cols = ["open", "high", "low", "close", "volume", "amount"]
    ok = np.ones((4, 6))
    ok[1, 2] = np.nan  # NaN is another check's business
    ok[2, 4] = 3.0e38  # large but representable
    check_float32_range(ok, cols, "a.csv", first_row=2)
    check_float32_range(np.full((3, 6), 2**62, dtype=np.int64), cols, "a.csv")
    bad = ok.copy()
    bad[3, 0] = -np.inf
    bad[2, 5] = 1e39
    with pytest.raises(Float32RangeError) as info:
        check_float32_range(bad, cols, "a.csv", first_row=2)
    assert str(info.value).startswith("a.csv line 4, column 'amount': value 1e+39 is a value float32 cannot hold")
    assert "(2 such values in this file)" in str(info.value)
    with pytest.raises(Float32RangeError, match="b.csv line 1, column 'volume': value -5e\\+40"):
        check_float32_range(np.array([-5e40]), ["volume"], "b.csv")
    tiny = np.full((3, 6), 3e-5)
    tiny[1, 3] = 1e-46  # nonzero, 0 in float32: trained on as 0 if let through
    with pytest.raises(Float32RangeError, match="c.csv line 3, column 'close': value 1e-46 is a value float32 cannot"):
        check_float32_range(tiny, cols, "c.csv", first_row=2)
