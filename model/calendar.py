"""The trading calendar of one series, learned from its history (`TradingCalendar.learn`), so that the bars after
its end are stamped at times that occur (those stamps also feed the model's time features). The rules for intraday,
daily and longer bars, `dates` and `holidays`: docs/architecture.md, "Formats and designs"."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

from model.errors import DataError, MissingExtraError
from model.features import to_datetime_index

RECENT_WEEKS = 8  # the history that defines the calendar (a market changes its hours; DST moves UTC sessions)
DAY, WEEK = pd.Timedelta(days=1), pd.Timedelta(days=7)
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


class HolidaysNotSkipped(UserWarning):
    """Business-day forecasts made without a holiday calendar: a holiday is stamped as a trading day."""


def holiday_calendar(name: str):
    """The `holidays` package's calendar `name` (a market, else a country): a date-keyed mapping that fills its
    years as they are asked for. MissingExtraError naming the extra when the package is absent."""
    try:
        import holidays  # the `calendars` extra: only a forecast that names a holiday calendar needs it
    except ModuleNotFoundError:
        raise MissingExtraError.for_module("holidays", f"the holiday calendar {name!r}") from None
    for listed, make in ((holidays.list_supported_financial(), holidays.financial_holidays),
                         (holidays.list_supported_countries(), holidays.country_holidays)):
        if name in listed:
            return make(name)
    raise DataError(f"holidays={name!r} is neither a market of holidays.list_supported_financial() (e.g. 'NYSE', "
                    "'XNYS') nor a country of holidays.list_supported_countries() (e.g. 'US', 'GB')")


@dataclass(frozen=True)
class TradingCalendar:
    """When one market trades; build it with `learn`, use it with `after`."""

    step: pd.Timedelta  # the bar length (median spacing of the recent bars)
    times: dict[int, np.ndarray]  # weekday (Monday=0) -> sorted bar times of day (int64 ns since midnight)
    typical: np.ndarray  # bar times of a listed trading date whose weekday never traded
    offset: pd.DateOffset | None = None  # bars longer than a day: their pandas frequency
    dates: pd.DatetimeIndex | None = None  # the trading dates (midnight), None = every date of a trading weekday
    tz: object = None  # the zone of the history's stamps (None = naive)
    holidays: object = None  # the days it does not trade (`holiday_calendar`), None = none known

    @classmethod
    def learn(cls, history, dates=None, name: str = "the series", holidays: str | None = None) -> TradingCalendar:
        """The calendar of one series from its timestamps (T >= 2, increasing); `dates`: its trading dates;
        `holidays`: a `holiday_calendar` name."""
        closed = None if holidays is None else holiday_calendar(holidays)
        ts = to_datetime_index(history, f"the timestamps of {name}")
        if len(ts) < 2:
            raise DataError(f"{name} has {len(ts)} row(s): too few to learn its trading calendar; pass freq= or "
                            "the future timestamps")
        wall = (ts.tz_localize(None) if ts.tz is not None else ts).as_unit("ns")
        recent = wall[wall > wall[-1] - RECENT_WEEKS * WEEK]
        recent = recent if len(recent) > 2 else wall[-3:]
        step = pd.Series(recent).diff().median()
        days = None if dates is None else pd.DatetimeIndex(to_datetime_index(dates, "dates")).normalize().unique()
        if step > 1.5 * DAY:  # weekly / monthly bars
            with warnings.catch_warnings():  # pandas warns that infer_freq will return an offset; both work
                warnings.simplefilter("ignore")
                freq = pd.infer_freq(wall[-5:]) if len(wall) >= 3 else None
            offset = pd.tseries.frequencies.to_offset(freq or step)
            return cls(step, {}, np.zeros(0, np.int64), offset, days, ts.tz, closed)
        date = recent.normalize()
        tod = (recent - date).asi8  # time of day, ns
        unique = date.unique()
        day = unique.get_indexer(date)  # (T,) each bar's date, as an index into `unique`
        weeks = (unique[-1] - unique[0]) / WEEK
        counts = pd.Series(unique.day_of_week).value_counts()
        traded = {int(d) for d, c in counts.items() if c >= weeks / 2} | (set(range(5)) if weeks < 1 else set())
        traded = traded or set(counts.index)

        def common(keep: np.ndarray) -> np.ndarray:
            """Times of day seen on at least half of the dates selected by `keep` ((D,) bool over `unique`) that
            cover them: the first date (maybe cut by the window) covers its times from its first bar on, the last
            (maybe cut mid-session) up to its last bar, so a partial day votes only on the times it saw."""
            t, c = np.unique(tod[keep[day]], return_counts=True)
            covering = keep[1:-1].sum() + (keep[0] & (t >= tod[0])) + (keep[-1] & (t <= tod[-1]))
            return t[c >= covering / 2]

        if step >= DAY / 2:  # daily bars: one per trading day, at the last bar's time of day
            typical = np.array([tod[-1]])
            times = {d: typical for d in traded}
        elif len(unique) < 3:  # no whole day seen: its session is unknown, the bars continue at their spacing
            return cls(step, {}, np.zeros(0, np.int64), pd.tseries.frequencies.to_offset(step), days, ts.tz, closed)
        else:
            typical = common(np.ones(len(unique), bool))
            times, borrowed = {}, []
            for d in sorted(traded):
                own = np.asarray(unique.day_of_week == d)
                if not own[1:-1].any():  # no whole session of this weekday: the other weekdays' (the typical) one
                    times[d] = typical
                    borrowed.append(_WEEKDAYS[d])
                    continue
                t = common(own)  # a time the typical session trades inside this weekday's hours is open too
                times[d] = np.union1d(t, typical[(typical >= t[0]) & (typical <= t[-1])]) if len(t) else t
            if borrowed:
                warnings.warn(f"{name}: {len(unique)} day(s) of recent history hold no whole session of "
                              f"{', '.join(borrowed)}: its bars after the history are stamped on the other weekdays' "
                              "session; give a few weeks of history for each weekday's own hours", stacklevel=2)
        if not len(typical) or not any(len(t) for t in times.values()):
            raise DataError(f"{name}: no time of day recurs in its bars, so they follow no trading calendar; pass "
                            "freq= or the future timestamps")
        if step >= DAY / 2 and sorted(times) == list(range(5)) and days is None and closed is None:
            warnings.warn("daily bars on business days are forecast onto every weekday, holidays included: no holiday "
                          "calendar is set; name one with holidays='NYSE' (predict_df, TradingCalendar.learn) or "
                          "forecast.holidays: NYSE (pip install 'kronos-finetune[calendars]'), or list the trading "
                          "dates (forecast.calendar)", HolidaysNotSkipped, stacklevel=2)
        return cls(step, times, typical, None, days, ts.tz, closed)

    def after(self, last, n: int, freq: str | None = None, name: str = "the series") -> pd.DatetimeIndex:
        """The `n` bar timestamps after `last` (ascending, in the calendar's zone), at `freq` when given."""
        last = pd.Timestamp(last)
        if (last.tz is None) != (self.tz is None):
            raise DataError(f"{name}: the last timestamp {last} and the calendar's stamps (zone {self.tz}) are not "
                            "both tz-aware or both naive; use one convention")
        wall = last.tz_convert(self.tz).tz_localize(None) if last.tz is not None else last
        m = n
        while True:  # a DST change drops the wall-clock times that do not exist and merges repeated ones
            stamps = self._wall_after(wall, m, freq, name)
            if self.tz is None:
                return stamps
            local = stamps.tz_localize(self.tz, ambiguous=np.ones(m, bool), nonexistent="NaT").dropna().unique()
            if len(local) >= n:
                return local[:n]
            m *= 2

    def _wall_after(self, wall: pd.Timestamp, n: int, freq: str | None, name: str) -> pd.DatetimeIndex:
        if freq is not None:
            try:
                offset = pd.tseries.frequencies.to_offset(freq)
            except ValueError:
                raise DataError(f"freq {freq!r} is not a pandas frequency string (e.g. '5min', 'h', 'D', 'B')") \
                    from None
            out, start = [], wall
            for _ in range(64):  # chunks of candidates, bounded: a freq may meet no trading time at all
                stamps = pd.date_range(start + offset, periods=max(4 * n, 64), freq=offset)
                out.extend(stamps[self._trades(stamps)])
                start = stamps[-1]
                if len(out) >= n:
                    break
            if len(out) < n:
                raise DataError(f"{name}: freq {freq!r} stamps {len(out)} of {n} bars at times its market trades; "
                                "pass another freq or the future timestamps")
            return pd.DatetimeIndex(out[:n])
        if self.offset is not None:
            return pd.date_range(wall + self.offset, periods=n, freq=self.offset)
        return pd.DatetimeIndex(self._sessions(wall, n, name)).as_unit("ns")

    def _sessions(self, wall: pd.Timestamp, n: int, name: str) -> list[pd.Timestamp]:
        out, day = [], wall.normalize()
        while len(out) < n:
            if self.dates is not None:
                if day > self.dates[-1]:
                    raise DataError(f"{name}: the trading dates given end on {self.dates[-1].date()}; {n} bars "
                                    f"after {wall} need more: extend the calendar")
                times = self.times.get(day.weekday(), self.typical) if day in self.dates else ()
            else:
                times = self.times.get(day.weekday(), ())
            times = () if self.holidays is not None and day in self.holidays else times
            out.extend(t for t in (day + pd.Timedelta(int(x)) for x in times) if t > wall)
            day += DAY
        return out[:n]

    def _trades(self, stamps: pd.DatetimeIndex) -> np.ndarray:
        """(N,) bool: the stamp starts inside a learned bar of its weekday (on a listed date)."""
        if self.offset is not None:
            return np.ones(len(stamps), bool)
        stamps = stamps.as_unit("ns")
        date = stamps.normalize()
        tod, ok = (stamps - date).asi8, np.zeros(len(stamps), bool)
        for d, times in self.times.items():
            on = stamps.day_of_week == d
            i = np.searchsorted(times, tod[on], side="right") - 1  # the learned bar starting last before it
            ok[on] = (i >= 0) & (tod[on] < times[np.maximum(i, 0)] + self.step.value)
        closed = np.array([d in self.holidays for d in date], bool) if self.holidays is not None else np.zeros_like(ok)
        return ok & (date.isin(self.dates) if self.dates is not None else True) & ~closed
