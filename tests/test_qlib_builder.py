"""finetune.qlib_builder: the folder it writes is read back by Qlib itself (qlib.init + D.features + a backtest)."""

import logging
import runpy
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from finetune.qlib_builder import (FIELDS, build_qlib_provider, equal_weight_index, load_csv_folder, qlib_fields,
                                   validate_daily_frames)
from finetune.synthetic import generate_ohlcv, write_csv_folder

qlib = pytest.importorskip("qlib")
# Qlib's own trade indicators average an empty order list on days the strategy only holds; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_qlib_data.py"
START, END = "2023-01-02", "2023-06-30"


def _ragged_frames() -> dict[str, pd.DataFrame]:
    """Four daily series over H1 2023 with different listing spans and a two-day suspension."""
    frames = generate_ohlcv(4, None, "1D", start=START, end=END, seed=11)
    frames["SH600001"] = frames["SH600001"].iloc[15:].reset_index(drop=True)  # listed later
    frames["SH600002"] = frames["SH600002"].iloc[:100].reset_index(drop=True)  # delisted earlier
    frames["SH600003"] = frames["SH600003"].drop(index=[40, 41]).reset_index(drop=True)  # suspended 2 days
    return frames


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(csv frames as read back, provider folder): CSVs written, loaded and built; Qlib initialised once."""
    root = tmp_path_factory.mktemp("qlib")
    write_csv_folder(_ragged_frames(), root / "csv")
    frames = load_csv_folder(root / "csv")
    out = build_qlib_provider(frames, root / "provider", universe="csi300", benchmark="SH000300")
    # kernels=1: features are read in this process (no joblib worker pool on a 2-core test machine);
    # no caches, so nothing is written outside the provider folder.
    qlib.init(provider_uri=str(out), region="cn", kernels=1, expression_cache=None, dataset_cache=None,
              logging_level=logging.WARNING)
    return frames, out


def _csv_table(frames, symbol):
    df = frames[symbol]
    return df.assign(timestamps=pd.to_datetime(df["timestamps"])).set_index("timestamps")


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


def test_qlib_reads_back_the_csv_numbers(built):
    frames, _ = built
    from qlib.data import D

    fields = ["$open", "$close", "$volume", "$vwap", "$factor", "$change"]
    got = D.features(D.instruments("csi300"), fields, start_time=START, end_time=END, freq="day")
    assert sorted(got.index.get_level_values("instrument").unique()) == sorted(frames)
    for symbol in frames:
        csv = _csv_table(frames, symbol)
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


def test_benchmark_is_equal_weighted_index(built):
    frames, _ = built
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


def test_backtest_smoke(built):
    """The kwargs the Qlib pipeline's evaluation uses: TopkDropout on a random signal over the built folder."""
    frames, _ = built
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


# ---- without Qlib: the pure parts, validation and the CLI ----

def test_given_benchmark_is_written_as_is(tmp_path):
    frames = generate_ohlcv(3, 30, "1D", start=START, seed=2)
    index_csv = frames.pop("SH600002").assign(close=lambda d: d["close"] * 10)
    out = build_qlib_provider({**frames, "sh000905": index_csv}, tmp_path / "p", universe="csi500",
                              benchmark="SH000905")
    assert [ln.split("\t")[0] for ln in (out / "instruments" / "csi500.txt").read_text().splitlines()] == [
        "SH600000", "SH600001"]
    close = np.fromfile(out / "features" / "sh000905" / "close.day.bin", dtype="<f4")
    np.testing.assert_allclose(close[1:], index_csv["close"], rtol=1e-6)


def test_qlib_fields_and_index_on_a_tiny_table():
    days = pd.to_datetime(["2024-01-02", "2024-01-03", "2024-01-05"])
    a = pd.DataFrame({"timestamps": days, "open": [10, 11, 12.0], "high": [11, 12, 13.0], "low": [9, 10, 11.0],
                      "close": [10, 11, 12.1], "volume": [100, 0, 50.0], "amount": [1000, 0, 600.0]})
    t = qlib_fields(a)
    np.testing.assert_allclose(t["vwap"], [10.0, np.nan, 12.0])  # zero volume -> no vwap
    np.testing.assert_allclose(t["change"], [np.nan, 0.1, 0.1], rtol=1e-12)
    b = a.assign(close=[20, 20, 22.0], open=[20, 20, 22.0], high=[21, 21, 23.0], low=[19, 19, 21.0])
    idx = equal_weight_index({"A": t, "B": qlib_fields(b.iloc[[0, 2]])})  # B skips 2024-01-03
    # Day 2: only A has a return (+10%); day 3: A +10%, B +10% (from its last close 20).
    np.testing.assert_allclose(idx["close"], [1000.0, 1100.0, 1210.0])
    np.testing.assert_allclose(idx["volume"], [200.0, 0.0, 100.0])


def test_validation_lists_every_problem_and_writes_nothing(tmp_path):
    csv = tmp_path / "csv"
    csv.mkdir()
    good = generate_ohlcv(1, 5, "1D", seed=0)["SH600000"]
    good.drop(columns=["amount"]).to_csv(csv / "noamount.csv", index=False)
    good.assign(timestamps=["2024-01-02", "not a date", "2024-01-04", "2024-01-05", "2024-01-08"]).to_csv(
        csv / "baddate.csv", index=False)
    generate_ohlcv(1, 5, "5min", seed=0)["SH600000"].to_csv(csv / "intraday.csv", index=False)
    good.assign(timestamps=["2024-01-02"] * 2 + ["2024-01-03"] * 3).to_csv(csv / "dups.csv", index=False)
    good.assign(close=[1.0, -2.0, 1.0, 1.0, 1.0]).to_csv(csv / "negative.csv", index=False)
    with pytest.raises(ValueError) as err:
        build_qlib_provider(load_csv_folder(csv), tmp_path / "out")
    msg = str(err.value)
    for expected in ["NOAMOUNT: missing columns ['amount']", "BADDATE: unparseable timestamps at rows 1",
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
    cli = runpy.run_path(str(SCRIPT))["main"]  # the script's own code, no sys.path change
    cli(["--synthetic", "3", "--out", str(tmp_path / "demo"), "--start", "2024-01-02", "--end", "2024-03-29"])
    calendar = (tmp_path / "demo" / "calendars" / "day.txt").read_text().split()
    assert calendar[0] == "2024-01-02" and calendar[-1] == "2024-03-29"
    assert "3 symbols" in capsys.readouterr().out
    write_csv_folder(generate_ohlcv(2, 20, "1D", seed=1), tmp_path / "csv")
    cli(["--csv-dir", str(tmp_path / "csv"), "--out", str(tmp_path / "fromcsv"), "--universe", "mkt",
         "--benchmark", "IDX"])
    assert (tmp_path / "fromcsv" / "instruments" / "mkt.txt").read_text().count("\n") == 2
    assert (tmp_path / "fromcsv" / "features" / "idx" / "close.day.bin").exists()


def test_dates_in_other_formats_and_time_zones_are_read_as_local_days():
    df = generate_ohlcv(1, 3, "1D", seed=0)["SH600000"]
    df["timestamps"] = ["2024-01-02", "2024/01/03", "2024-01-04T00:00:00+08:00"]
    clean = validate_daily_frames({"SH600000": df})["SH600000"]
    assert list(clean["timestamps"]) == list(pd.to_datetime(["2024-01-02", "2024-01-03", "2024-01-04"]))
