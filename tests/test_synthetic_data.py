"""finetune.synthetic: determinism, candle invariants, session calendar, stylised facts, CSV output, CLI."""

import importlib

import numpy as np
import pandas as pd
import pytest

from finetune.synthetic import (
    COLUMNS,
    MIX_FREQS,
    MIX_SESSIONS,
    generate_mix,
    generate_ohlcv,
    mix_timestamps,
    session_offsets,
    write_csv_folder,
)

SESSION_BOUNDS = [("09:30", "11:30"), ("13:00", "15:00")]


def _lag1_autocorr(x: np.ndarray) -> float:
    x = x - x.mean()
    return float((x[1:] * x[:-1]).mean() / (x * x).mean())


def test_same_seed_same_data_other_seed_differs():
    a = generate_ohlcv(3, 500, "5min", seed=7)
    b = generate_ohlcv(3, 500, "5min", seed=7)
    c = generate_ohlcv(3, 500, "5min", seed=8)
    assert list(a) == ["SH600000", "SH600001", "SH600002"]
    for sym in a:
        pd.testing.assert_frame_equal(a[sym], b[sym])
        assert not np.allclose(a[sym]["close"], c[sym]["close"])


@pytest.mark.parametrize("freq", ["1min", "5min", "15min", "60min", "1D"])
def test_candle_invariants(freq):
    frames = generate_ohlcv(4, 3000, freq, seed=1)
    for df in frames.values():
        assert list(df.columns) == COLUMNS and len(df) == 3000
        o, h, l, c, v, a = (df[k].to_numpy() for k in ["open", "high", "low", "close", "volume", "amount"])
        assert np.isfinite(np.stack([o, h, l, c, v, a])).all()
        assert (l > 0).all() and (v >= 0).all()
        assert (h >= np.maximum(o, c)).all() and (l <= np.minimum(o, c)).all()
        np.testing.assert_allclose(a, v * (h + l + c) / 3.0, rtol=1e-12)
        assert df["timestamps"].is_monotonic_increasing and df["timestamps"].is_unique


@pytest.mark.parametrize("freq,per_day", [("1min", 240), ("5min", 48), ("15min", 16), ("60min", 4)])
def test_intraday_bars_only_inside_sessions_on_weekdays(freq, per_day):
    assert len(session_offsets(freq)) == per_day
    ts = generate_ohlcv(1, per_day * 12 + 3, freq, start="2024-01-05", seed=0)["SH600000"]["timestamps"]
    assert (ts.dt.day_of_week < 5).all()
    hhmm = ts.dt.strftime("%H:%M")
    inside = np.zeros(len(ts), dtype=bool)
    for lo, hi in SESSION_BOUNDS:
        inside |= ((hhmm >= lo) & (hhmm < hi)).to_numpy()
    assert inside.all()
    counts = ts.dt.date.value_counts().sort_index()
    assert (counts.iloc[:-1] == per_day).all() and counts.iloc[-1] == 3
    assert ts.iloc[0] == pd.Timestamp("2024-01-05 09:30")  # a Friday
    assert ts.iloc[per_day] == pd.Timestamp("2024-01-08 09:30")  # the weekend is skipped


def test_daily_bars_are_business_days_and_end_is_inclusive():
    ts = generate_ohlcv(2, None, "1D", start="2024-01-01", end="2024-02-29", seed=0)["SH600001"]["timestamps"]
    expected = pd.bdate_range("2024-01-01", "2024-02-29")
    assert list(ts) == list(expected) and len(ts) == 23 + 21  # weekdays of Jan + Feb 2024


def test_volatility_clusters():
    # Daily bars: no intraday seasonality that would create autocorrelation in squared returns by itself.
    frames = generate_ohlcv(4, 2000, "1D", seed=3)
    acs = [_lag1_autocorr(np.diff(np.log(df["close"].to_numpy())) ** 2) for df in frames.values()]
    assert min(acs) > 0.0 and np.mean(acs) > 0.05  # iid returns: ~0 +- 0.02


def test_volume_u_shape_and_reacts_to_moves():
    df = generate_ohlcv(1, 48 * 200, "5min", seed=2)["SH600000"]
    by_bar = df.groupby(df["timestamps"].dt.strftime("%H:%M"))["volume"].mean()
    midday = by_bar[["10:45", "11:00", "11:15", "13:30", "13:45"]].mean()
    assert by_bar["09:30"] > 1.5 * midday and by_bar["14:55"] > 1.5 * midday
    # Volume relative to its time-of-day mean rises with |return|.
    rel_volume = df["volume"] / df.groupby(df["timestamps"].dt.time)["volume"].transform("mean")
    abs_ret = np.abs(np.log(df["close"] / df["open"]))
    assert np.corrcoef(rel_volume, abs_ret)[0, 1] > 0.2


def test_overnight_gap_only_at_the_first_bar_of_a_day():
    df = generate_ohlcv(1, 48 * 20, "5min", seed=4)["SH600000"]
    new_day = df["timestamps"].dt.date.ne(df["timestamps"].dt.date.shift()).to_numpy()[1:]
    jump = (df["open"].to_numpy()[1:] / df["close"].to_numpy()[:-1]) - 1.0
    np.testing.assert_allclose(jump[~new_day], 0.0, atol=1e-12)
    assert (np.abs(jump[new_day]) > 1e-6).all()


def test_write_csv_folder_round_trip(tmp_path):
    intraday = generate_ohlcv(2, 100, "5min", seed=0)
    daily = {f"D{k}": v for k, v in generate_ohlcv(1, 10, "1D", seed=0).items()}
    paths = write_csv_folder({**intraday, **daily}, tmp_path / "csv")
    assert [p.name for p in paths] == ["DSH600000.csv", "SH600000.csv", "SH600001.csv"]
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == [p.name for p in paths]  # no temp files left
    raw = pd.read_csv(paths[1], dtype={"timestamps": str})
    assert list(raw.columns) == COLUMNS
    assert raw["timestamps"].iloc[1] == "2024-01-02 09:35:00"
    assert pd.read_csv(paths[0], dtype={"timestamps": str})["timestamps"].iloc[0] == "2024-01-02"
    back = raw.assign(timestamps=pd.to_datetime(raw["timestamps"]))
    pd.testing.assert_frame_equal(back, intraday["SH600000"], check_exact=False, rtol=1e-12)


def test_write_csv_folder_rejects_missing_columns(tmp_path):
    bad = generate_ohlcv(1, 5, "1D")["SH600000"].drop(columns=["amount"])
    with pytest.raises(ValueError, match=r"SH600000: missing columns \['amount'\]"):
        write_csv_folder({"SH600000": bad}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_arguments_name_the_setting():
    with pytest.raises(ValueError, match="freq='2min'.*1D"):
        generate_ohlcv(1, 10, "2min")
    with pytest.raises(ValueError, match="exactly one of n_bars"):
        generate_ohlcv(1, 10, "1D", end="2024-03-01")
    with pytest.raises(ValueError, match="--n-series"):
        generate_ohlcv(0, 10)


def test_cli_writes_csvs(tmp_path, capsys):
    make_synthetic_main = importlib.import_module("finetune.synthetic").main  # kronos's command
    make_synthetic_main(["--out", str(tmp_path / "d"), "--n-series", "3", "--n-bars", "50", "--freq", "15min",
                         "--seed", "5"])
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == ["SH600000.csv", "SH600001.csv", "SH600002.csv"]
    df = pd.read_csv(tmp_path / "d" / "SH600002.csv")
    expected = generate_ohlcv(3, 50, "15min", seed=5)["SH600002"]
    np.testing.assert_allclose(df["close"], expected["close"], rtol=1e-12)
    assert "wrote 3 CSVs x 50 bars" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# generate_mix: the broad pretraining mix (scripts/make_pretrained_demo.py)



@pytest.fixture(scope="module")
def mix():
    return generate_mix(40, 1500, seed=3)


def test_mix_same_seed_same_data_other_seed_differs():
    a, b, c = generate_mix(6, 300, seed=1), generate_mix(6, 300, seed=1), generate_mix(6, 300, seed=2)
    assert [s.name for s in a] == [s.name for s in b]
    for x, y, z in zip(a, b, c):
        pd.testing.assert_frame_equal(x.frame, y.frame)
        assert not np.allclose(x.frame["close"], z.frame["close"])


def test_mix_candle_invariants_and_names(mix):
    assert len({s.name for s in mix}) == len(mix) == 40
    for s in mix:
        df = s.frame
        assert list(df.columns) == COLUMNS and len(df) == 1500
        o, h, l, c, v, a = (df[k].to_numpy() for k in ["open", "high", "low", "close", "volume", "amount"])
        assert np.isfinite(np.stack([o, h, l, c, v, a])).all(), s.name
        assert (l > 0).all() and (v >= 0).all()
        assert (h >= np.maximum(o, c)).all() and (l <= np.minimum(o, c)).all()
        np.testing.assert_allclose(a, v * (h + l + c) / 3.0, rtol=1e-12)
        assert df["timestamps"].is_monotonic_increasing and df["timestamps"].is_unique
        assert s.name.startswith(f"mix{mix.index(s):03d}_{s.session}_{s.freq}_{s.dynamics}")


def test_mix_is_broad(mix):
    assert [s.freq for s in mix[:5]] == list(MIX_FREQS)  # every bar length, in turn
    assert {s.session for s in mix} == set(MIX_SESSIONS)
    assert {s.dynamics for s in mix} == {"trend", "mean_revert", "momentum"}
    first_close = np.array([s.frame["close"].iloc[0] for s in mix])
    assert first_close.max() / first_close.min() > 100  # price levels span orders of magnitude
    daily_vol = [np.std(np.diff(np.log(s.frame["close"].to_numpy()))) for s in mix if s.freq == "1D"]
    assert max(daily_vol) / min(daily_vol) > 2  # calm and wild markets
    levels = np.array([s.frame["volume"].mean() for s in mix])
    assert levels.max() / levels.min() > 100


def test_mix_calendars_differ_from_the_demo_market():
    # The demo market trades 09:30-11:30 and 13:00-15:00 (lunch break); no mix calendar has a break.
    us = mix_timestamps("5min", "us", "2024-01-05", 78 * 3)
    assert us[0] == pd.Timestamp("2024-01-05 09:30") and us[77] == pd.Timestamp("2024-01-05 15:55")
    assert us[78] == pd.Timestamp("2024-01-08 09:30")  # Friday -> Monday
    eu = mix_timestamps("60min", "eu", "2024-01-02", 9)
    assert list(eu.strftime("%H:%M")) == ["08:00", "09:00", "10:00", "11:00", "12:00", "13:00", "14:00", "15:00",
                                          "16:00"][:8] + ["08:00"]
    fx = mix_timestamps("15min", "fx24x5", "2024-01-05", 96 + 1)
    assert fx[95] == pd.Timestamp("2024-01-05 23:45") and fx[96] == pd.Timestamp("2024-01-08 00:00")
    crypto = mix_timestamps("1D", "crypto24x7", "2024-01-05", 4)
    assert list(crypto.day_of_week) == [4, 5, 6, 0]  # trades on weekends
    for name, (sessions, _) in MIX_SESSIONS.items():
        assert len(sessions) == 1, f"{name}: a session break would imitate the demo market"
    with pytest.raises(ValueError, match="session='asia'"):
        mix_timestamps("5min", "asia", "2024-01-02", 10)


def _ac1(x: np.ndarray) -> float:
    return _lag1_autocorr(x)


def _variance_ratio(r: np.ndarray, k: int = 50) -> float:
    rk = np.convolve(r, np.ones(k), mode="valid")[::k]
    return float(rk.var() / (k * r.var()))


def test_mix_dynamics_behave_as_named(mix):
    # Bar returns within a day (no overnight gap), per series.
    rets = {}
    for s in mix:
        df = s.frame
        same_day = (df["timestamps"].dt.normalize().diff() == pd.Timedelta(0)).to_numpy()[1:]
        r = np.diff(np.log(df["close"].to_numpy()))
        rets[s.name] = (s, r if s.freq == "1D" or s.session == "crypto24x7" else r[same_day])
    vr = {d: np.mean([_variance_ratio(r) for s, r in rets.values() if s.dynamics == d]) for d in
          ("trend", "mean_revert", "momentum")}
    assert vr["mean_revert"] < 0.75 * vr["trend"]  # pulled back: long-horizon variance below k x short
    ac = {d: np.mean([abs(_ac1(r)) for s, r in rets.values() if s.dynamics == d]) for d in ("trend", "momentum")}
    assert ac["momentum"] > 0.05 and ac["momentum"] > 2 * ac["trend"]
    # Volatility clusters (GARCH + regimes): squared returns are autocorrelated.
    clus = [_ac1(r**2) for s, r in rets.values() if s.freq == "1D"]
    assert np.mean(clus) > 0.05


def test_mix_bad_arguments():
    with pytest.raises(ValueError, match="--n-series"):
        generate_mix(0, 100)
    with pytest.raises(ValueError, match="--n-bars"):
        generate_mix(2, 1)
