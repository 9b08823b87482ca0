"""Synthetic OHLCV markets: realistic enough to exercise the pipelines, deterministic by seed.

    frames = generate_ohlcv(n_series=8, n_bars=20_000, freq="5min", seed=0)   # {"SH600000": DataFrame, ...}
    kronos make-synthetic --out data/synthetic_5min --n-series 8 --n-bars 20000 --freq 5min   # one CSV per symbol
    kronos make-synthetic --out data/synthetic_daily --freq 1D --start 2018-01-02 --end 2023-12-29

The model of prices, sessions and volume: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from model.errors import DataError
from model.fileio import atomic_write

COLUMNS = ["timestamps", "open", "high", "low", "close", "volume", "amount"]
SESSIONS = (("09:30", "11:30"), ("13:00", "15:00"))  # (start, end) of each trading session, end exclusive
FREQ_MINUTES = {"1min": 1, "5min": 5, "15min": 15, "60min": 60, "1D": None}
TRADING_DAYS_PER_YEAR = 252
OVERNIGHT_VAR_SHARE = 0.2  # share of a day's return variance that happens between sessions (the gap)


def session_offsets(freq: str, sessions: tuple[tuple[str, str], ...] = SESSIONS) -> pd.TimedeltaIndex:
    """Start times (offsets from midnight) of the bars of one trading day of `sessions` ((start, end) "HH:MM", end
    exclusive, "24:00" = midnight); `[0]` for daily bars."""
    if freq not in FREQ_MINUTES:
        raise DataError(f"freq={freq!r} is not supported; choose one of {sorted(FREQ_MINUTES)}")
    minutes = FREQ_MINUTES[freq]
    if minutes is None:
        return pd.TimedeltaIndex([pd.Timedelta(0)])
    parts = []
    for start, end in sessions:
        lo, hi = pd.Timedelta(f"{start}:00"), pd.Timedelta(f"{end}:00")
        parts.append(pd.timedelta_range(lo, hi - pd.Timedelta(minutes=minutes), freq=f"{minutes}min"))
    return parts[0].append(parts[1:])


def trading_timestamps(freq: str, start: str, n_bars: int | None = None, end: str | None = None,
                       sessions: tuple[tuple[str, str], ...] = SESSIONS, weekends: bool = False) -> pd.DatetimeIndex:
    """Bar timestamps of `sessions` from `start` on weekdays (every day with `weekends`): the first `n_bars`, or
    every bar up to the day `end` inclusive."""
    if (n_bars is None) == (end is None):
        raise DataError("give exactly one of n_bars (--n-bars) or end (--end)")
    offsets = session_offsets(freq, sessions)
    first_day, day_freq = pd.Timestamp(start).normalize(), "D" if weekends else "B"
    if n_bars is not None:
        if n_bars < 1:
            raise DataError(f"n_bars={n_bars} must be >= 1 (--n-bars)")
        n_days = -(-n_bars // len(offsets))  # ceil
        days = pd.date_range(first_day, periods=n_days, freq=day_freq)
    else:
        days = pd.date_range(first_day, pd.Timestamp(end).normalize(), freq=day_freq)
        if len(days) == 0:
            raise DataError(f"no weekday between start={start} and end={end} (--start / --end)")
    # (n_days, bars_per_day) grid of day + offset, flattened in time order.
    grid = days.values[:, None] + offsets.values[None, :]
    stamps = pd.DatetimeIndex(grid.ravel())
    return stamps[:n_bars] if n_bars is not None else stamps


def _intraday_profiles(offsets: pd.TimedeltaIndex) -> tuple[np.ndarray, np.ndarray]:
    """(volatility, volume) multipliers per bar of the day, each with mean 1: U-shaped over the trading day."""
    n = len(offsets)
    if n == 1:
        return np.ones(1), np.ones(1)
    u = np.linspace(-1.0, 1.0, n)  # position in the trading day, open = -1, close = +1
    vol = 0.7 + 0.9 * u**2
    volume = 0.5 + 2.0 * u**2
    # A small bump when the afternoon session opens after lunch, as seen on Asian exchanges.
    afternoon = np.flatnonzero(offsets >= pd.Timedelta(f"{SESSIONS[1][0]}:00"))
    if len(afternoon):
        volume[afternoon[0]] *= 1.5
    return vol / vol.mean(), volume / volume.mean()


def _garch_innovations(z: np.ndarray, jumps: np.ndarray, alpha: np.ndarray, beta: np.ndarray,
                       target_var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GARCH(1,1): e_t = sqrt(h_t) z_t + jump_t, h_{t+1} = w + alpha e_t^2 + beta h_t. Inputs (T, S); returns (e, h)."""
    omega = target_var * (1.0 - alpha - beta)  # (S,) so that the unconditional variance is target_var
    e = np.empty_like(z)
    h = np.empty_like(z)
    h_t = target_var.copy()
    for t in range(z.shape[0]):
        h[t] = h_t
        e_t = np.sqrt(h_t) * z[t] + jumps[t]
        e[t] = e_t
        # Cap the variance so a huge jump cannot blow up the series; 50x the target is already extreme.
        h_t = np.minimum(omega + alpha * e_t * e_t + beta * h_t, 50.0 * target_var)
    return e, h


def generate_ohlcv(n_series: int = 8, n_bars: int | None = None, freq: str = "5min", start: str = "2024-01-02",
                   seed: int = 0, end: str | None = None, intraday_drift: float = 0.0) -> dict[str, pd.DataFrame]:
    """Synthetic OHLCV(A) series, identical for the same arguments: {symbol: DataFrame} with symbols SH600000,
    SH600001, ... and columns `timestamps` (datetime64), open, high, low, close, volume, amount (float64), one row per
    bar. Give exactly one of `n_bars` or `end`. `intraday_drift` > 0: the walk-forward demo's predictable time-of-day
    drift (README "Does finetuning pay?"; docs/architecture.md, "Formats and designs"); 0 = the data is unchanged."""
    if n_series < 1:
        raise DataError(f"n_series={n_series} must be >= 1 (--n-series)")
    stamps = trading_timestamps(freq, start, n_bars=n_bars, end=end)
    offsets = session_offsets(freq)
    T, S, per_day = len(stamps), n_series, len(offsets)
    rng = np.random.default_rng(seed)

    # Per-series character, annualised then scaled to one bar (S,).
    ann_vol = rng.uniform(0.15, 0.45, S)
    ann_drift = rng.normal(0.05, 0.10, S)
    day_var = ann_vol**2 / TRADING_DAYS_PER_YEAR
    bar_var = (1.0 - OVERNIGHT_VAR_SHARE) * day_var / per_day
    bar_drift = ann_drift / (TRADING_DAYS_PER_YEAR * per_day)
    alpha = rng.uniform(0.05, 0.12, S)
    beta = rng.uniform(0.95, 0.975, S) - alpha  # persistence alpha + beta in [0.95, 0.975)
    price0 = np.exp(rng.uniform(np.log(5.0), np.log(200.0), S))
    volume0 = np.exp(rng.uniform(np.log(2e5), np.log(5e6), S)) / per_day  # typical shares per bar

    # Bar position in the day and day boundaries (T,).
    bar_in_day = np.arange(T) % per_day
    day_open = bar_in_day == 0
    day_open[0] = False  # no gap before the first bar: it opens at price0
    vol_profile, volume_profile = _intraday_profiles(offsets)

    # Returns: GARCH innovations with rare jumps, times the U-shaped intraday volatility profile (T, S).
    z = rng.standard_normal((T, S))
    jump_prob = 3.0 / (TRADING_DAYS_PER_YEAR * per_day)  # about three jumps a year per series
    jumps = (rng.random((T, S)) < jump_prob) * rng.normal(0.0, 6.0, (T, S)) * np.sqrt(bar_var)
    e, h = _garch_innovations(z, jumps, alpha, beta, bar_var)
    rel_vol = np.sqrt(h / bar_var)  # (T, S) current volatility regime, ~1 on average
    ret = bar_drift + e * vol_profile[bar_in_day, None]  # (T, S) open-to-close log return of each bar
    if intraday_drift:  # (per_day,) mean return by bar of the day in units of bar volatility; sums to 0 over a day
        season = intraday_drift * np.cos(2 * np.pi * np.arange(per_day) / per_day)
        ret = ret + season[bar_in_day, None] * np.sqrt(bar_var)
    # Overnight gap, larger in turbulent regimes (T, S); zero except on the first bar of each day.
    gap = day_open[:, None] * rng.standard_normal((T, S)) * np.sqrt(OVERNIGHT_VAR_SHARE * day_var) * rel_vol

    log_close = np.log(price0) + np.cumsum(gap + ret, axis=0)
    close = np.exp(log_close)
    open_ = np.exp(log_close - ret)
    # Wicks: half-normal excursions beyond the body, scaled by the bar's volatility.
    bar_sd = np.sqrt(h) * vol_profile[bar_in_day, None]
    high = np.maximum(open_, close) * np.exp(np.abs(rng.standard_normal((T, S))) * 0.6 * bar_sd)
    low = np.minimum(open_, close) * np.exp(-np.abs(rng.standard_normal((T, S))) * 0.6 * bar_sd)

    # Volume: intraday U-shape x volatility regime x surprise |z| x lognormal noise, whole shares (T, S).
    surprise = np.abs(ret - bar_drift) / np.sqrt(bar_var) / vol_profile[bar_in_day, None]
    noise = np.exp(rng.normal(-0.125, 0.5, (T, S)))
    volume = np.round(volume0 * volume_profile[bar_in_day, None] * rel_vol**0.5 * (0.5 + 0.6 * surprise) * noise)
    volume = np.maximum(volume, 0.0)
    amount = volume * (high + low + close) / 3.0  # typical price

    return {f"SH{600000 + s:06d}": pd.DataFrame({"timestamps": stamps, "open": open_[:, s], "high": high[:, s],
                                                 "low": low[:, s], "close": close[:, s], "volume": volume[:, s],
                                                 "amount": amount[:, s]}) for s in range(S)}


def write_csv_folder(frames: dict[str, pd.DataFrame], out_dir: str | os.PathLike) -> list[Path]:
    """Write one `<symbol>.csv` per frame (columns COLUMNS, ISO timestamps); returns the paths written, sorted.

    Each file is written to a temporary name and renamed into place, so a failure leaves no half-written CSV."""
    problems = [f"{sym}: missing columns {sorted(set(COLUMNS) - set(df.columns))}"
                for sym, df in frames.items() if not set(COLUMNS) <= set(df.columns)]
    if problems:
        raise DataError("cannot write CSVs:\n  " + "\n  ".join(problems))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for symbol, df in sorted(frames.items()):
        stamps = pd.to_datetime(df["timestamps"])
        fmt = "%Y-%m-%d" if (stamps == stamps.dt.normalize()).all() else "%Y-%m-%d %H:%M:%S"
        path = out / f"{symbol}.csv"
        frame = df.assign(timestamps=stamps)[COLUMNS]
        atomic_write(path, lambda tmp, frame=frame, fmt=fmt: frame.to_csv(tmp, index=False, date_format=fmt))
        paths.append(path)
    return paths


# A broad mix of markets, for pretraining a small starting model (scripts/make_pretrained_demo.py).
#
# Deliberately unlike the demo market above (5-minute bars in two Asian sessions with a lunch break, Gaussian
# GARCH, pure random walk): the mix has other session calendars (US, European, 24x5 FX-like, 24x7 crypto-like),
# five bar lengths, fat-tailed GARCH with regime switches, trends, mean reversion and short-term momentum or
# reversal, and several intraday profiles. A model pretrained on it knows candles in general; finetuning on the
# demo market then has that market's calendar and dynamics left to learn.

MIX_FREQS = ("1min", "5min", "15min", "60min", "1D")
MIX_SESSIONS = {  # name -> (sessions as (start, end) strings, trades on weekends)
    "us": ((("09:30", "16:00"),), False),
    "eu": ((("08:00", "16:30"),), False),
    "fx24x5": ((("00:00", "24:00"),), False),
    "crypto24x7": ((("00:00", "24:00"),), True),
}
MIX_DYNAMICS = ("trend", "mean_revert", "momentum")


def mix_timestamps(freq: str, session: str, start: str, n_bars: int) -> pd.DatetimeIndex:
    """The first `n_bars` bar times from `start` for a `MIX_SESSIONS` calendar (bars labelled by their start)."""
    if session not in MIX_SESSIONS:
        raise DataError(f"session={session!r} is not supported; choose one of {sorted(MIX_SESSIONS)}")
    sessions, weekends = MIX_SESSIONS[session]
    return trading_timestamps(freq, start, n_bars, sessions=sessions, weekends=weekends)


def _mix_profile(frac: np.ndarray, hour: np.ndarray, round_the_clock: bool, rng: np.random.Generator) -> np.ndarray:
    """A random intraday multiplier with mean ~1 per bar: U/J-shaped over a session, or a 24-hour cycle."""
    if round_the_clock:  # busiest around one random hour of the day
        peak, amp = rng.uniform(0, 24), rng.uniform(0.0, 0.6)
        prof = 1.0 + amp * np.cos(2 * np.pi * (hour - peak) / 24.0)
    else:
        u = 2.0 * frac - 1.0  # position in the session, open = -1, close = +1
        prof = 1.0 + rng.uniform(0.0, 1.5) * u**2 + rng.uniform(-0.5, 0.5) * u
    prof = np.maximum(prof, 0.2)
    return prof / prof.mean()


@dataclass(frozen=True)
class MixSeries:
    """One series of the mix: its candles and what generated them."""

    name: str  # Unique name, e.g. 'mix007_crypto24x7_15min_trend'.
    frame: pd.DataFrame  # Columns COLUMNS (timestamps datetime64, prices/volume/amount float64), one row per bar.
    freq: str  # Bar length, one of MIX_FREQS.
    session: str  # Calendar, one of MIX_SESSIONS.
    # 'trend' (drifting random walk), 'mean_revert' (log price pulled back to a level) or 'momentum' (autocorrelated
    # returns, positive or negative).
    dynamics: str


def generate_mix(n_series: int = 48, n_bars: int = 3000, seed: int = 0, start: str = "2021-01-04") -> list[MixSeries]:
    """A broad, deterministic mix of synthetic markets; series i has freq MIX_FREQS[i % 5] (all five appear once
    n_series >= 5), and a random calendar, dynamics, price level, volatility, volume level and intraday profile.

    Returns n_series `MixSeries` of n_bars rows each; identical for the same arguments."""
    if n_series < 1:
        raise DataError(f"n_series={n_series} must be >= 1 (--n-series)")
    if n_bars < 2:
        raise DataError(f"n_bars={n_bars} must be >= 2 (--n-bars)")
    rng = np.random.default_rng([seed, 0x6D6978])  # distinct stream from generate_ohlcv's for the same seed
    out = []
    for i in range(n_series):
        freq, session = MIX_FREQS[i % len(MIX_FREQS)], str(rng.choice(sorted(MIX_SESSIONS)))
        dynamics = str(rng.choice(MIX_DYNAMICS))
        stamps = mix_timestamps(freq, session, start, n_bars)
        T = n_bars
        day = stamps.normalize()
        first_bar = np.r_[False, day[1:] != day[:-1]]  # (T,) first bar of each day (no gap before bar 0)
        round_the_clock = MIX_SESSIONS[session][0][0] == ("00:00", "24:00")
        # Fraction of the way through the day's bars (0..1) and hour, for the intraday profiles (T,).
        pos = np.arange(T) - np.maximum.accumulate(np.where(np.r_[True, first_bar[1:]], np.arange(T), 0))
        per_day = max(int(pd.Series(day).value_counts().max()), 1)
        frac = pos / max(per_day - 1, 1)
        hour = stamps.hour.to_numpy() + stamps.minute.to_numpy() / 60.0
        intraday = FREQ_MINUTES[freq] is not None
        vol_prof = _mix_profile(frac, hour, round_the_clock, rng) if intraday else np.ones(T)
        volu_prof = _mix_profile(frac, hour, round_the_clock, rng) if intraday else np.ones(T)

        # Volatility: GARCH(1,1) with Student-t shocks, times a two-state regime (calm / turbulent) (T,).
        bar_sd = rng.uniform(0.15, 1.2) / np.sqrt(TRADING_DAYS_PER_YEAR * per_day)  # annual vol 15%..120%
        dof = rng.uniform(3.5, 10.0)
        z = rng.standard_t(dof, T) / np.sqrt(dof / (dof - 2))  # unit variance
        persistence = rng.uniform(0.85, 0.985)
        alpha = rng.uniform(0.03, 0.15) * persistence
        stay = rng.uniform(0.995, 0.9995)  # regime persistence per bar
        switches = rng.random(T) > stay
        regime = np.where(np.cumsum(switches) % 2 == 1, rng.uniform(1.8, 3.0), 1.0)  # (T,) vol multiplier
        e, h = _garch_innovations(z[:, None], np.zeros((T, 1)), np.array([alpha]),
                                  np.array([persistence - alpha]), np.array([bar_sd**2]))
        shock = e[:, 0] * regime * vol_prof  # (T,)

        # Drift, mean reversion and return autocorrelation: one recursion over time (T,).
        drift = rng.uniform(-0.03, 0.03) * bar_sd if dynamics == "trend" else 0.0
        kappa = rng.uniform(0.005, 0.05) if dynamics == "mean_revert" else 0.0
        phi = rng.choice([-1, 1]) * rng.uniform(0.05, 0.25) if dynamics == "momentum" else 0.0
        ret = np.empty(T)
        dev, prev = 0.0, 0.0
        for t in range(T):
            prev = drift + phi * prev - kappa * dev + shock[t]
            dev += prev
            ret[t] = prev
        gap_sd = rng.uniform(0.0, 3.0) * bar_sd * np.sqrt(regime)
        gap = first_bar * rng.standard_normal(T) * gap_sd if not round_the_clock else np.zeros(T)

        log_close = np.log(np.exp(rng.uniform(np.log(0.05), np.log(5000.0)))) + np.cumsum(gap + ret)
        close = np.exp(log_close)
        open_ = np.exp(log_close - ret)
        wick_sd = np.sqrt(h[:, 0]) * regime * vol_prof * rng.uniform(0.3, 1.0)
        high = np.maximum(open_, close) * np.exp(np.abs(rng.standard_normal(T)) * wick_sd)
        low = np.minimum(open_, close) * np.exp(-np.abs(rng.standard_normal(T)) * wick_sd)

        # Volume: level x profile x regime x reaction to the move x slow drift x noise, whole units (T,).
        surprise = np.abs(ret) / (np.sqrt(h[:, 0]) * regime * vol_prof)
        level = np.exp(rng.uniform(np.log(50.0), np.log(1e7)))
        slow = np.exp(np.cumsum(rng.normal(0.0, 0.01, T)))
        noise = np.exp(rng.normal(0.0, rng.uniform(0.2, 0.8), T))
        volume = np.round(level * volu_prof * regime**rng.uniform(0.3, 1.0) * (0.4 + rng.uniform(0.2, 1.0) * surprise)
                          * slow * noise)
        amount = volume * (high + low + close) / 3.0
        frame = pd.DataFrame({"timestamps": stamps, "open": open_, "high": high, "low": low, "close": close,
                              "volume": volume, "amount": amount})
        out.append(MixSeries(f"mix{i:03d}_{session}_{freq}_{dynamics}", frame, freq, session, dynamics))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kronos make-synthetic",
                                description="Write synthetic OHLCV candles, one CSV per symbol (`generate_ohlcv`).")
    p.add_argument("--out", required=True, help="folder to write <symbol>.csv files into")
    p.add_argument("--n-series", type=int, default=8, help="number of symbols")
    p.add_argument("--n-bars", type=int, default=None, help="bars per symbol (default 20000 unless --end is given)")
    p.add_argument("--end", default=None, help="last day (YYYY-MM-DD) instead of --n-bars")
    p.add_argument("--freq", default="5min", choices=list(FREQ_MINUTES), help="bar length")
    p.add_argument("--start", default="2024-01-02", help="first day (YYYY-MM-DD)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same data")
    p.add_argument("--intraday-drift", type=float, default=0.0,
                   help="predictable time-of-day drift in bar volatilities (the walk-forward demo uses 0.5; 0 = none)")
    args = p.parse_args(argv)
    if args.n_bars is not None and args.end is not None:
        p.error("give --n-bars or --end, not both")
    if args.n_bars is None and args.end is None:
        args.n_bars = 20_000
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        frames = generate_ohlcv(args.n_series, args.n_bars, freq=args.freq, start=args.start, seed=args.seed,
                                end=args.end, intraday_drift=args.intraday_drift)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    paths = write_csv_folder(frames, args.out)
    n_rows = len(next(iter(frames.values())))
    print(f"wrote {len(paths)} CSVs x {n_rows} bars ({args.freq}) to {args.out}")

