"""finetune.qlib_builder: the folder it writes is read back by Qlib itself (qlib.init + D.features + a backtest)."""

import importlib
import json
import logging
import warnings

import numpy as np
import pandas as pd
import pytest

from finetune.qlib_builder import (
    FIELDS,
    SubstituteBenchmarkWarning,
    build_qlib_provider,
    equal_weight_index,
    load_csv_folder,
    qlib_fields,
    validate_daily_frames,
)
from finetune.synthetic import generate_ohlcv, write_csv_folder

qlib = pytest.importorskip("qlib")
# Qlib's own trade indicators average an empty order list on days the strategy only holds; harmless.
# Tests that build without a benchmark table and do not check the warning (pytest.warns still sees it).
pytestmark = [pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::finetune.qlib_builder.SubstituteBenchmarkWarning")]

START, END = "2023-01-02", "2023-06-30"


def _ragged_frames() -> dict[str, pd.DataFrame]:
    """Four daily series over H1 2023 with different listing spans and suspensions (missing, zero-volume, no close)."""
    frames = generate_ohlcv(4, None, "1D", start=START, end=END, seed=11)
    frames["SH600001"] = frames["SH600001"].iloc[15:].reset_index(drop=True)  # listed later
    frames["SH600002"] = frames["SH600002"].iloc[:100].reset_index(drop=True)  # delisted earlier
    frames["SH600003"] = frames["SH600003"].drop(index=[40, 41]).reset_index(drop=True)  # suspended 2 days
    frames["SH600000"].loc[50:52, ["volume", "amount"]] = 0.0  # a zero-volume stretch with prices still quoted
    frames["SH600003"].loc[60, "close"] = np.nan  # a day without a close
    return frames


ZERO_VOLUME_DAYS = pd.bdate_range(START, periods=53)[50:53]  # SH600000 rows 50..52
NO_CLOSE_DAY = pd.bdate_range(START, periods=63)[62]  # SH600003 row 60 after its two missing days


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(csv frames as read back, provider folder): CSVs written, loaded and built; Qlib initialised once."""
    root = tmp_path_factory.mktemp("qlib")
    write_csv_folder(_ragged_frames(), root / "csv")
    frames = load_csv_folder(root / "csv")
    with pytest.warns(SubstituteBenchmarkWarning, match="equal-weighted index of the 4 universe symbols"):
        out = build_qlib_provider(frames, root / "provider", universe="csi300", benchmark="SH000300")
    return frames, out


def init_qlib(provider) -> None:
    """Point Qlib at `provider`. kernels=1: features are read in this process (no joblib worker pool on a 2-core
    test machine); no caches, so nothing is written outside the provider folder."""
    qlib.init(provider_uri=str(provider), region="cn", kernels=1, expression_cache=None, dataset_cache=None,
              logging_level=logging.WARNING)


@pytest.fixture
def on_built(built):
    """`built`, with Qlib initialised on it (other tests may point Qlib elsewhere)."""
    init_qlib(built[1])
    return built


def _csv_table(frames, symbol):
    """A symbol's CSV rows indexed by date, suspended rows (zero volume or no close) blanked as the store does."""
    df = frames[symbol]
    t = df.assign(timestamps=pd.to_datetime(df["timestamps"])).set_index("timestamps")
    t.loc[~(t["volume"] > 0) | t["close"].isna(), :] = np.nan
    return t


def test_layout_on_disk(built):
    frames, out = built
    calendar = (out / "calendars" / "day.txt").read_text().split()
    union = sorted({d for df in frames.values() for d in df["timestamps"]})
    assert calendar == union and calendar[0] == START and calendar[-1] == END
    universe = (out / "instruments" / "csi300.txt").read_text().splitlines()
    assert universe[1] == f"SH600001\t{frames['SH600001']['timestamps'].iloc[0]}\t{END}"
    assert universe[2] == f"SH600002\t{START}\t{frames['SH600002']['timestamps'].iloc[-1]}"
    assert [line.split("\t")[0] for line in universe] == ["SH600000", "SH600001", "SH600002", "SH600003"]
    all_symbols = [line.split("\t")[0] for line in (out / "instruments" / "all.txt").read_text().splitlines()]
    assert all_symbols == ["SH000300", "SH600000", "SH600001", "SH600002", "SH600003"]
    for symbol in all_symbols:
        assert sorted(p.name for p in (out / "features" / symbol.lower()).iterdir()) == sorted(
            f"{f}.day.bin" for f in FIELDS)
    # Raw bin: [start index, values over the calendar from the first to the last listed day], float32 LE.
    raw = np.fromfile(out / "features" / "sh600001" / "close.day.bin", dtype="<f4")
    assert raw[0] == 15 and len(raw) - 1 == len(calendar) - 15
    np.testing.assert_allclose(raw[1:], frames["SH600001"]["close"], rtol=1e-6)
    suspended = np.fromfile(out / "features" / "sh600003" / "open.day.bin", dtype="<f4")
    assert raw.dtype == np.float32 and np.isnan(suspended[1 + 40]) and np.isnan(suspended[1 + 41])


def test_qlib_reads_back_the_csv_numbers(on_built):
    frames, _ = on_built
    from qlib.data import D

    fields = ["$open", "$close", "$volume", "$vwap", "$factor", "$change"]
    got = D.features(D.instruments("csi300"), fields, start_time=START, end_time=END, freq="day")
    assert sorted(got.index.get_level_values("instrument").unique()) == sorted(frames)
    for symbol in frames:
        full = _csv_table(frames, symbol)
        csv = full.dropna(subset=["close"])
        q = got.xs(symbol, level="instrument").dropna(subset=["$close"])
        assert list(q.index) == list(csv.index)  # every CSV row is there, nothing else has a close
        np.testing.assert_allclose(q["$open"], csv["open"], rtol=1e-6)
        np.testing.assert_allclose(q["$close"], csv["close"], rtol=1e-6)
        np.testing.assert_allclose(q["$volume"], csv["volume"], rtol=1e-6)
        np.testing.assert_allclose(q["$vwap"], csv["amount"] / csv["volume"], rtol=1e-6)
        assert (q["$factor"] == 1.0).all()
        expected_change = csv["close"] / csv["close"].shift(1) - 1.0  # across a suspension: from the last close
        np.testing.assert_allclose(q["$change"].iloc[1:], expected_change.iloc[1:], rtol=1e-5, atol=1e-7)
        assert np.isnan(q["$change"].iloc[0])

    assert D.list_instruments(D.instruments("csi300"), as_list=True) == sorted(frames)
    calendar = D.calendar(start_time=START, end_time=END, freq="day")
    assert len(calendar) == len(pd.bdate_range(START, END)) and calendar[0] == pd.Timestamp(START)
    # A symbol's span follows its CSV: SH600002 has no data after its last row.
    late = D.features(["SH600002"], ["$close"], start_time="2023-06-01", end_time=END, freq="day")
    assert late["$close"].isna().all()


def test_suspended_days_are_nan_in_every_field(on_built):
    """Zero volume or no close -> NaN in every field, which is how Qlib's exchange recognises a suspension."""
    _, out = on_built
    from qlib.data import D

    fields = [f"${f}" for f in FIELDS]
    got = D.features(["SH600000", "SH600003"], fields, start_time=START, end_time=END, freq="day")
    a, b = got.xs("SH600000", level="instrument"), got.xs("SH600003", level="instrument")
    assert a.loc[ZERO_VOLUME_DAYS].isna().all().all() and b.loc[NO_CLOSE_DAY].isna().all()
    assert a.drop(index=ZERO_VOLUME_DAYS).iloc[1:].notna().all().all()  # nothing else is blank (day 1: no change)
    assert b.isna().all(axis=1).sum() == 3  # two missing rows + the day without a close
    info = json.loads((out / "build_info.json").read_text())
    assert info["suspended_days"] == {"SH600000": 3, "SH600003": 1}
    assert info["benchmark_source"].startswith("substitute")


def test_benchmark_is_equal_weighted_index(on_built):
    frames, _ = on_built
    from qlib.data import D

    bench = D.features(["SH000300"], ["$open", "$high", "$low", "$close", "$volume"], start_time=START,
                       end_time=END, freq="day").xs("SH000300", level="instrument")
    closes = pd.DataFrame({s: _csv_table(frames, s)["close"] for s in frames})
    mean_ret = (closes / closes.ffill().shift(1) - 1.0).mean(axis=1).fillna(0.0)
    assert bench["$close"].iloc[0] == pytest.approx(1000.0)
    np.testing.assert_allclose(bench["$close"].pct_change().iloc[1:], mean_ret.iloc[1:], rtol=1e-4, atol=1e-6)
    assert (bench["$high"] >= np.maximum(bench["$open"], bench["$close"]) * (1 - 1e-6)).all()
    assert (bench["$low"] <= np.minimum(bench["$open"], bench["$close"]) * (1 + 1e-6)).all()
    volumes = pd.DataFrame({s: _csv_table(frames, s)["volume"] for s in frames}).sum(axis=1)
    np.testing.assert_allclose(bench["$volume"], volumes, rtol=1e-6)


def test_backtest_smoke(on_built):
    """The kwargs the Qlib pipeline's evaluation uses: TopkDropout on a random signal over the built folder."""
    frames, _ = on_built
    from qlib.backtest import backtest
    from qlib.contrib.evaluate import risk_analysis
    from qlib.contrib.strategy import TopkDropoutStrategy
    from qlib.data import D

    calendar = D.calendar(start_time="2023-02-01", end_time="2023-04-28", freq="day")
    index = pd.MultiIndex.from_product([calendar, sorted(frames)], names=["datetime", "instrument"])
    signal = pd.Series(np.random.default_rng(0).standard_normal(len(index)), index=index)
    strategy = TopkDropoutStrategy(signal=signal, topk=2, n_drop=1)
    executor = {"class": "SimulatorExecutor", "module_path": "qlib.backtest.executor",
                "kwargs": {"time_per_step": "day", "generate_portfolio_metrics": True, "verbose": False}}
    exchange_kwargs = {"freq": "day", "limit_threshold": 0.095, "deal_price": "close",
                       "open_cost": 0.0005, "close_cost": 0.0015, "min_cost": 5}
    portfolio, _ = backtest(start_time=calendar[0], end_time=calendar[-1], strategy=strategy, executor=executor,
                            benchmark="SH000300", account=1e8, exchange_kwargs=exchange_kwargs)
    report, _ = portfolio["1day"]
    assert len(report) == len(calendar)
    assert report["total_turnover"].iloc[-1] > 0 and (report["cost"] > 0).any()
    bench_close = D.features(["SH000300"], ["$close"], start_time=calendar[0], end_time=calendar[-1],
                             freq="day")["$close"].to_numpy()
    np.testing.assert_allclose(report["bench"].iloc[1:], bench_close[1:] / bench_close[:-1] - 1.0, rtol=1e-4)
    risk = risk_analysis(report["return"] - report["bench"] - report["cost"], freq="day")
    assert set(risk.index) >= {"mean", "std", "annualized_return", "information_ratio", "max_drawdown"}
    assert np.isfinite(risk["risk"]).all()


def test_membership_spells_round_trip_through_qlib(tmp_path):
    """A point-in-time membership file becomes instruments/<universe>.txt; Qlib reads back every spell."""
    frames = generate_ohlcv(3, 60, "1D", start=START, seed=4)
    members = pd.DataFrame({"symbol": ["sh600000", "SH600000", "SH600001"],
                            "start": ["2023-01-02", "2023-02-20", "2023-01-16"],
                            "end": ["2023-01-31", "2023-03-24", "2023-03-10"]})
    (tmp_path / "members.csv").write_text(members.to_csv(index=False))
    with pytest.warns(SubstituteBenchmarkWarning):
        out = build_qlib_provider(frames, tmp_path / "p", universe="mkt", membership=tmp_path / "members.csv")
    assert (out / "instruments" / "mkt.txt").read_text().splitlines() == [
        "SH600000\t2023-01-02\t2023-01-31", "SH600000\t2023-02-20\t2023-03-24", "SH600001\t2023-01-16\t2023-03-10"]
    assert len((out / "instruments" / "all.txt").read_text().splitlines()) == 4  # SH600002 stays loadable
    init_qlib(out)
    from qlib.data import D

    spans = D.list_instruments(D.instruments("mkt"), as_list=False)
    assert {s: [(f"{a:%Y-%m-%d}", f"{b:%Y-%m-%d}") for a, b in v] for s, v in spans.items()} == {
        "SH600000": [("2023-01-02", "2023-01-31"), ("2023-02-20", "2023-03-24")],
        "SH600001": [("2023-01-16", "2023-03-10")]}
    on_day = D.list_instruments(D.instruments("mkt"), start_time="2023-02-06", end_time="2023-02-10", as_list=True)
    assert on_day == ["SH600001"]  # SH600000 is out of the universe between its two spells
    assert json.loads((out / "build_info.json").read_text())["point_in_time_membership"] is True


def test_membership_problems_are_listed_and_nothing_is_written(tmp_path):
    frames = generate_ohlcv(2, 20, "1D", start=START, seed=0)
    bad = pd.DataFrame({"symbol": ["SH600000", "SH600000", "SH600009", "SH600001", "SH000300"],
                        "start": ["2023-01-02", "2023-01-10", "2023-01-02", "not a day", "2023-01-02"],
                        "end": ["2023-01-20", "2023-01-25", "2023-01-05", "2023-01-05", "2023-01-05"]})
    with pytest.raises(ValueError) as err:
        build_qlib_provider(frames, tmp_path / "p", membership=bad)
    msg = str(err.value)
    for expected in ["unparseable start at rows 3", "symbols without data: ['SH600009']",
                     "benchmark SH000300 cannot be a member", "--membership"]:
        assert expected in msg
    with pytest.raises(ValueError, match="overlapping spells for SH600000"):
        build_qlib_provider(frames, tmp_path / "p", membership=bad.iloc[:2])
    with pytest.raises(ValueError, match=r"start after end at rows 0"):
        build_qlib_provider(frames, tmp_path / "p", membership=bad.iloc[:1].assign(end="2022-12-30"))
    with pytest.raises(ValueError, match=r"missing columns \['end'\]"):
        build_qlib_provider(frames, tmp_path / "p", membership=bad[["symbol", "start"]])
    with pytest.raises(FileNotFoundError, match="--membership"):
        build_qlib_provider(frames, tmp_path / "p", membership=tmp_path / "nope.csv")
    assert list(tmp_path.iterdir()) == []


# ---- without Qlib: the pure parts, validation and the CLI ----

def test_given_benchmark_is_written_as_is(tmp_path):
    frames = generate_ohlcv(3, 30, "1D", start=START, seed=2)
    index_csv = frames.pop("SH600002").assign(close=lambda d: d["close"] * 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SubstituteBenchmarkWarning)  # the real index is given: no warning
        out = build_qlib_provider({**frames, "sh000905": index_csv}, tmp_path / "p", universe="csi500",
                                  benchmark="SH000905")
    assert json.loads((out / "build_info.json").read_text())["benchmark_source"] == "given table"
    assert [ln.split("\t")[0] for ln in (out / "instruments" / "csi500.txt").read_text().splitlines()] == [
        "SH600000", "SH600001"]
    close = np.fromfile(out / "features" / "sh000905" / "close.day.bin", dtype="<f4")
    np.testing.assert_allclose(close[1:], index_csv["close"], rtol=1e-6)


def test_qlib_fields_and_index_on_a_tiny_table():
    days = pd.to_datetime(["2024-01-02", "2024-01-03", "2024-01-04", "2024-01-05"])
    a = pd.DataFrame({"timestamps": days, "open": [10, 11, 11, 12.0], "high": [11, 12, 12, 13.0],
                      "low": [9, 10, 10, 11.0], "close": [10, 11, np.nan, 12.1], "volume": [100, 80, 30, 50.0],
                      "amount": [1000, 880, 330, 600.0]})
    a0 = a.assign(volume=[100, 0, 30, 50.0])  # zero volume on day 2
    t = qlib_fields(a)
    assert t.loc["2024-01-04"].isna().all()  # no close: suspended, every field NaN
    np.testing.assert_allclose(t["vwap"], [10.0, 11.0, np.nan, 12.0])
    np.testing.assert_allclose(t["change"], [np.nan, 0.1, np.nan, 0.1], rtol=1e-12)  # day 4 from day 2's close
    t0 = qlib_fields(a0)
    assert t0.loc["2024-01-03"].isna().all() and t0.loc["2024-01-05"].notna().all()
    b = a.assign(close=[20, 20, 21, 22.0], open=[20, 20, 21, 22.0], high=[21, 21, 22, 23.0], low=[19, 19, 20, 21.0])
    idx = equal_weight_index({"A": t, "B": qlib_fields(b.iloc[[0, 2, 3]])})  # B skips 2024-01-03
    # Day 2: only A trades (+10%); day 3: only B (+5% from its last close 20); day 4: A +10%, B +4.76%.
    np.testing.assert_allclose(idx["close"], 1000.0 * np.cumprod([1.0, 1.1, 1.05, 1 + (0.1 + 22 / 21 - 1) / 2]))
    np.testing.assert_allclose(idx["volume"], [200.0, 80.0, 30.0, 100.0])


def test_suspension_count_is_logged(tmp_path, caplog):
    frames = generate_ohlcv(2, 10, "1D", seed=0)
    frames["SH600001"].loc[[2, 5], "volume"] = 0.0
    with caplog.at_level(logging.INFO, logger="finetune.qlib_builder"), pytest.warns(SubstituteBenchmarkWarning):
        build_qlib_provider(frames, tmp_path / "p")
    assert "SH600001: 2 day(s) with zero/missing volume or missing close" in caplog.text
    assert "SH600000" not in caplog.text


def test_validation_lists_every_problem_and_writes_nothing(tmp_path):
    csv = tmp_path / "csv"
    csv.mkdir()
    good = generate_ohlcv(1, 5, "1D", seed=0)["SH600000"]
    good.drop(columns=["volume"]).to_csv(csv / "novolume.csv", index=False)  # amount alone is derived, volume not
    good.assign(timestamps=["2024-01-02", "not a date", "2024-01-04", "2024-01-05", "2024-01-08"]).to_csv(
        csv / "baddate.csv", index=False)
    generate_ohlcv(1, 5, "5min", seed=0)["SH600000"].to_csv(csv / "intraday.csv", index=False)
    good.assign(timestamps=["2024-01-02"] * 2 + ["2024-01-03"] * 3).to_csv(csv / "dups.csv", index=False)
    good.assign(close=[1.0, -2.0, 1.0, 1.0, 1.0]).to_csv(csv / "negative.csv", index=False)
    with pytest.raises(ValueError) as err:
        build_qlib_provider(load_csv_folder(csv), tmp_path / "out")
    msg = str(err.value)
    for expected in ["NOVOLUME: no 'volume' column", "BADDATE: unparseable timestamps at rows 1",
                     "'not a date'", "INTRADAY: intraday timestamps", "DUPS: duplicate dates at rows 0, 1, 2",
                     "NEGATIVE: column 'close' is <= 0 at rows 1", "--csv-dir"]:
        assert expected in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["csv"]  # no output, no staging folder left


def test_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--csv-dir"):
        load_csv_folder(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no \*\.csv files"):
        load_csv_folder(tmp_path / "empty")
    with pytest.raises(ValueError, match="--universe"):
        build_qlib_provider(generate_ohlcv(1, 5, "1D"), tmp_path / "o", universe="all")


def test_existing_output_needs_overwrite(tmp_path):
    out = tmp_path / "p"
    build_qlib_provider(generate_ohlcv(2, 10, "1D", seed=0), out)
    with pytest.raises(FileExistsError, match="--overwrite"):
        build_qlib_provider(generate_ohlcv(3, 10, "1D", seed=0), out)
    assert len((out / "instruments" / "csi300.txt").read_text().splitlines()) == 2
    build_qlib_provider(generate_ohlcv(3, 10, "1D", seed=0), out, overwrite=True)
    assert len((out / "instruments" / "csi300.txt").read_text().splitlines()) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]  # old copy and staging folder removed


def test_cli_synthetic_and_csv_dir(tmp_path, capsys):
    cli = importlib.import_module("finetune.qlib_builder").main  # kronos's command
    cli(["--synthetic", "3", "--out", str(tmp_path / "demo"), "--start", "2024-01-02", "--end", "2024-03-29"])
    calendar = (tmp_path / "demo" / "calendars" / "day.txt").read_text().split()
    assert calendar[0] == "2024-01-02" and calendar[-1] == "2024-03-29"
    printed = capsys.readouterr()
    assert "3 symbols" in printed.out and "warning: no table for the benchmark SH000300" in printed.err
    write_csv_folder(generate_ohlcv(2, 20, "1D", seed=1), tmp_path / "csv")
    (tmp_path / "m.csv").write_text("symbol,start,end\nSH600001,2024-01-03,2024-01-10\n")
    cli(["--csv-dir", str(tmp_path / "csv"), "--out", str(tmp_path / "fromcsv"), "--universe", "mkt",
         "--benchmark", "IDX", "--membership", str(tmp_path / "m.csv")])
    assert (tmp_path / "fromcsv" / "instruments" / "mkt.txt").read_text() == "SH600001\t2024-01-03\t2024-01-10\n"
    with pytest.raises(SystemExit, match="(?s)error: .*symbols without data"):
        (tmp_path / "m.csv").write_text("symbol,start,end\nXYZ,2024-01-03,2024-01-10\n")
        cli(["--csv-dir", str(tmp_path / "csv"), "--out", str(tmp_path / "x"), "--membership", str(tmp_path / "m.csv")])
    assert (tmp_path / "fromcsv" / "features" / "idx" / "close.day.bin").exists()


def test_dates_in_other_formats_and_time_zones_are_read_as_local_days():
    df = generate_ohlcv(1, 3, "1D", seed=0)["SH600000"]
    df["timestamps"] = ["2024-01-02", "2024/01/03", "2024-01-04T00:00:00+08:00"]
    clean = validate_daily_frames({"SH600000": df})["SH600000"]
    assert list(clean["timestamps"]) == list(pd.to_datetime(["2024-01-02", "2024-01-03", "2024-01-04"]))


def test_columns_in_any_case_with_aliases_a_mapping_and_amount_derived(tmp_path):
    frames = generate_ohlcv(2, None, "1D", start=START, end="2023-02-28", seed=1)
    names = {"timestamps": "Date", "open": "Open", "high": "High", "low": "Low", "close": "Close", "volume": "Vol"}
    capitalised = {s: df.drop(columns="amount").rename(columns=names) for s, df in frames.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SubstituteBenchmarkWarning)
        out = build_qlib_provider(capitalised, tmp_path / "a", benchmark="SH000300")
        odd = {s: df.rename(columns={"timestamps": "Trade Day", "close": "Last"}) for s, df in frames.items()}
        build_qlib_provider(odd, tmp_path / "b", columns={"timestamps": "Trade Day", "close": "Last"})
    assert json.loads((out / "build_info.json").read_text())["amount_derived"] == sorted(frames)
    init_qlib(out)
    from qlib.data import D

    symbol, df = next(iter(frames.items()))
    got = D.features([symbol], ["$amount"], START, "2023-02-28")["$amount"].to_numpy()
    want = df["volume"] * df[["open", "high", "low", "close"]].mean(axis=1)
    np.testing.assert_allclose(got, want.to_numpy(), rtol=1e-5)
    renamed = {s: df.rename(columns={"close": "Closing"}) for s, df in frames.items()}
    with pytest.raises(ValueError, match=r"no 'close' column.*did you mean 'Closing'"):
        build_qlib_provider(renamed, tmp_path / "c")
    assert not (tmp_path / "c").exists()
