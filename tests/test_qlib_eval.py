"""The Qlib evaluation on a tiny synthetic Qlib folder with a deterministic forecaster (no model): membership,
gaps, suspensions, trade labels, the first test day, the report."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from finetune.evaluation.statistics import MIN_BLOCKS

pytest.importorskip("qlib")
from finetune import qlib_forecast as qf
from finetune.config import load
from finetune.dataset import load_split, read_manifest, split_path
from finetune.qlib_builder import build_qlib_provider
from finetune.qlib_data_preprocess import preprocess
from finetune.qlib_io import init_qlib
from finetune.qlib_test import evaluate, publish
from finetune.synthetic import generate_ohlcv
from model.errors import EXIT_CONFIG, EXIT_REFUSED, DataError
from model.fileio import check_seal

TEST = ["2022-04-01", "2022-05-31"]
LOOKBACK = 10


def config(tmp_path, qlib_dir, **backtest):
    cfg = {
        "data": {"qlib_data_path": str(qlib_dir), "instrument": "csi300", "dataset_begin_time": "2021-06-01",
                 "dataset_end_time": "2022-06-30", "train_time_range": ["2021-06-01", "2021-12-31"],
                 "val_time_range": ["2022-01-01", "2022-03-31"], "test_time_range": TEST, "lookback": LOOKBACK,
                 "predict": 3, "dataset_path": str(tmp_path / "processed"), "max_gap_days": 5},
        "model": {"pretrained_tokenizer": None, "pretrained_predictor": None},
        "paths": {"save_path": str(tmp_path / "models"), "backtest_result_path": str(tmp_path / "backtest")},
        "forecast": {"sample_count": 1, "batch_size": 64},
        "backtest": {"signals": ["mean", "last"], "topk": 2, "n_drop": 1, "hold_thresh": 1, "account": 1_000_000,
                     "deal_price": "close", **backtest},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load(path)


def momentum_forecaster(x, x_stamp, y_stamp):
    """Deterministic: extrapolate the context's last 3-bar close trend over P bars. (B, P)"""
    close = x[..., 3]
    slope = (close[:, -1] - close[:, -4]) / 3.0
    return close[:, -1:] + slope[:, None] * np.arange(1, y_stamp.shape[1] + 1)


def prepared(tmp_path, name, data, membership=None, **backtest):
    qdir = tmp_path / name / "qlib"
    build_qlib_provider(data, qdir, universe="csi300", benchmark="SH000300", membership=membership)
    cfg = config(tmp_path / name, qdir, **backtest)
    preprocess(cfg)
    return cfg


def signal_frame(cfg, forecaster=momentum_forecaster):
    """The test split's signals of `forecaster`, indexed by (datetime, instrument)."""
    split = load_split(split_path(cfg.data.dataset_path, "test"))
    cal = np.asarray(read_manifest(cfg.data.dataset_path)["calendar_ns"], dtype=np.int64)
    init_qlib(cfg)
    from qlib.data import D

    first = qf_first(cfg)
    ends = qf.forecast_window_ends(split, first.value, pd.Timestamp(TEST[1]).value, LOOKBACK)
    frame = qf.forecast_frame(split, ends, cal, forecaster, lookback=LOOKBACK, predict=3, freq="day", batch=16)
    del D
    return frame.set_index(["datetime", "instrument"]).sort_index()



def qf_first(cfg):
    from finetune.qlib_data_preprocess import first_signal_day

    init_qlib(cfg)
    from qlib.data import D

    return first_signal_day(pd.DatetimeIndex(D.calendar(freq="day")), pd.Timestamp(TEST[0]))


@pytest.fixture(scope="module")
def data():
    return generate_ohlcv(6, None, "1D", start="2021-06-01", end="2022-06-30", seed=3)


def test_store_is_memory_mapped_and_first_signal_day_precedes_the_test(tmp_path, data):
    cfg = prepared(tmp_path, "a", data)
    split = load_split(split_path(cfg.data.dataset_path, "test"))
    assert isinstance(split.features, np.memmap)
    signals = signal_frame(cfg)
    first = signals.index.get_level_values("datetime").min()
    assert first < pd.Timestamp(TEST[0]) and first == qf_first(cfg)


def test_poisoned_future_leaves_earlier_signals_unchanged(tmp_path, data):
    poison_day = pd.Timestamp("2022-05-02")
    bad = {}
    for s, df in data.items():
        df = df.copy()
        after = pd.to_datetime(df["timestamps"]) >= poison_day
        for c in ("open", "high", "low", "close"):
            df.loc[after, c] = df.loc[after, c] * 3.0
        bad[s] = df
    clean = signal_frame(prepared(tmp_path, "clean", data))
    poisoned = signal_frame(prepared(tmp_path, "poisoned", bad))
    before = clean.index.get_level_values("datetime") < poison_day
    pd.testing.assert_frame_equal(clean[before], poisoned.loc[clean.index[before]])
    assert not np.allclose(clean[~before]["last"], poisoned.loc[clean.index[~before], "last"])


def test_leave_and_rejoin_and_late_joiner(tmp_path, data):
    names = sorted(data)
    full = pd.DataFrame({"symbol": names, "start": "2021-06-01", "end": "2022-06-30"})
    gap = full.copy()
    s0, s1 = names[0], names[1]
    gap = gap[~gap.symbol.isin([s0, s1])]
    gap = pd.concat([gap, pd.DataFrame({"symbol": [s0, s0, s1], "start": ["2021-06-01", "2022-05-02", "2022-05-02"],
                                        "end": ["2022-04-15", "2022-06-30", "2022-06-30"]})])
    a = signal_frame(prepared(tmp_path, "full", data, membership=full))
    b = signal_frame(prepared(tmp_path, "gap", data, membership=gap))
    # the leaver/re-joiner: no signal while out, identical signals after re-entry
    day_b = b.xs(s0, level="instrument").index
    out = (day_b > pd.Timestamp("2022-04-15")) & (day_b < pd.Timestamp("2022-05-02"))
    assert not out.any()
    after = a.xs(s0, level="instrument").loc["2022-05-02":]
    pd.testing.assert_frame_equal(after, b.xs(s0, level="instrument").loc["2022-05-02":])
    # the late joiner: first signal on its join day, from prior history
    first = b.xs(s1, level="instrument").index.min()
    assert first == pd.Timestamp("2022-05-02")
    pd.testing.assert_series_equal(a.loc[(first, s1)], b.loc[(first, s1)])


def test_a_long_suspension_cuts_the_series_and_is_nan_in_the_store(tmp_path, data):
    sus = {s: df.copy() for s, df in data.items()}
    name = sorted(sus)[2]
    when = pd.to_datetime(sus[name]["timestamps"])
    stretch = (when >= "2022-04-11") & (when <= "2022-04-22")  # 10 trading days > max_gap_days 5
    sus[name].loc[stretch, "volume"] = 0.0
    cfg = prepared(tmp_path, "sus", sus)
    init_qlib(cfg)
    from qlib.data import D

    close = D.features([name], ["$close"], "2022-04-11", "2022-04-22")["$close"]
    assert close.isna().all()
    signals = signal_frame(cfg).xs(name, level="instrument")
    # no signal during the stretch, and none for the lookback days after it (the context never spans the gap)
    assert not ((signals.index >= "2022-04-11") & (signals.index <= "2022-04-22")).any()
    resume = signals.loc["2022-04-23":].index.min()
    assert resume == pd.bdate_range("2022-04-25", periods=LOOKBACK)[-1]
    assert read_manifest(cfg.data.dataset_path)["gap_cuts"] == {name: 1}
    # untraded: a score that ranks it first from the day before the stretch never buys it while suspended
    from finetune.qlib_test import run_backtest

    days = pd.DatetimeIndex(D.calendar(start_time="2022-04-07", end_time="2022-04-29"))
    idx = pd.MultiIndex.from_product([days, sorted(sus)], names=["datetime", "instrument"])
    score = pd.Series([1.0 if i == name else 0.0 for _, i in idx], index=idx)
    _, holdings = run_backtest(cfg, score, pd.Timestamp("2022-04-11"), pd.Timestamp("2022-04-22"))
    assert all(name not in held for held in holdings.values())


def test_report_perfect_foresight_first_day_and_strict_json(tmp_path, data):
    cfg = prepared(tmp_path, "rep", data, deal_price="close")
    init_qlib(cfg)
    from qlib.data import D

    from finetune.evaluation.signals import forward_labels

    calendar = pd.DatetimeIndex(D.calendar(freq="day"))
    split = load_split(split_path(cfg.data.dataset_path, "test"))
    cal_ns = np.asarray(read_manifest(cfg.data.dataset_path)["calendar_ns"], dtype=np.int64)
    report, files = evaluate(cfg, {"seed0": momentum_forecaster, "seed1": momentum_forecaster}, split, cal_ns, calendar)
    # first test day trades
    for name in ("mean@seed0", "momentum"):
        assert report["signals"][name]["backtest"]["first_day_turnover"] > 0
    assert set(report["seed_spread"]) == {"mean", "last"} and report["seed_spread"]["last"]["IC"]["std"] == 0.0
    assert report["signals"]["last@seed0"]["horizon"] == 3
    # 6 stocks: warned as too few for a cross-sectional IC (t still shown from 5 up); the substitute index is named
    assert any("only 6 instruments per forecast day" in w for w in report["warnings"])
    head = report["summary"]["last@seed0"]  # the rule's t: none on a span shorter than 16 stretches of h days
    assert math.isfinite(head["t_IC"]) == (head["days"] // 3 >= MIN_BLOCKS)
    assert report["benchmark"] == "SH000300 (substitute: equal-weighted index of 6 symbols)"
    assert report["summary"]["last@seed0"]["turnover"] > 0 and report["summary"]["last@seed0"]["cost_ann"] > 0
    best = report["best"]  # every signal at h = 3, the two seeds of each model as one entry
    assert best["horizon"] == 3 and best["line"].startswith("best by IC at h=3: ")
    assert {"last", "mean", "momentum"} <= set(best["ranking"]) and "last@seed0" not in best["ranking"]
    assert best["signal"] == max(best["ranking"], key=best["ranking"].get)
    out = publish(tmp_path / "out", report, files)
    json.loads((out / "report.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-strict {c}"))
    written = {p.name for p in out.iterdir()}
    assert {"summary.csv", "ic_decay.png", "cumulative_return.png", "backtest_daily.csv", "report.html"} <= written
    # sealed as a forecast folder: every file listed, so an edit is refused by name (kronos report included)
    sealed = {line.split("  ", 1)[1] for line in (out / "SHA256SUMS").read_text().splitlines()}
    assert sealed == written - {"SHA256SUMS"} and {"report.json", "signals.csv"} <= sealed
    check_seal(out, exact=True)
    (out / "signals.csv").write_text((out / "signals.csv").read_text().replace("0.", "0.9", 1))
    with pytest.raises(DataError, match="signals.csv is not the file written there"):
        check_seal(out)
    # a second run's folder replaces the whole first one: no file of the first is left beside the second's
    publish(out, {**report, "warnings": ["second"]}, {"signals.csv": files["signals.csv"]})
    assert {p.name for p in out.iterdir()} == {"report.json", "signals.csv", "report.html", "SHA256SUMS"}
    assert json.loads((out / "report.json").read_text())["warnings"] == ["second"]
    check_seal(out, exact=True)
    from finetune import cli

    assert cli.main(["report", str(out)]) == 0  # the page rebuilt from the sealed files, the folder sealed again
    check_seal(out, exact=True)

    # perfect foresight of the deal-price label: IC = 1 and the best long-short of all signals
    first = qf_first(cfg)
    names = sorted(set(split.names))
    lab = forward_labels(names, first, TEST[1], deal_price="close", horizons=1)
    from finetune.qlib_test import score_signal

    bt0, bt1 = pd.Timestamp(report["backtest_period"][0]), pd.Timestamp(report["backtest_period"][1])
    perfect, _ = score_signal(cfg, lab["label_1"].dropna(), lab, 1, bt0, bt1)
    assert perfect["headline"]["IC"] == pytest.approx(1.0) and perfect["headline"]["RankIC"] == pytest.approx(1.0)
    best_other = max(r["analysis"]["label_1"]["long_short"]["mean"] for r in report["signals"].values())
    assert perfect["headline"]["long_short"] > best_other
    assert perfect["backtest"]["excess_return_without_cost"]["annualized_return"] > max(
        r["backtest"]["excess_return_without_cost"]["annualized_return"] for r in report["signals"].values())
    assert math.isfinite(perfect["backtest"]["turnover_mean"])


def test_ic_val_metric_scores_minus_rank_ic_of_validation_forecasts(tmp_path, data):
    from tests.model_factory import tiny_models

    cfg = prepared(tmp_path, "val", data)
    val = load_split(split_path(cfg.data.dataset_path, "val"))
    tokenizer, predictor = tiny_models()
    calendar_ns = np.asarray(read_manifest(cfg.data.dataset_path)["calendar_ns"], dtype=np.int64)
    metric = qf.make_ic_val_metric(cfg, val, tokenizer, calendar_ns, max_days=4, device="cpu")
    predictor.train()
    first = metric(predictor)
    assert predictor.training  # the model is handed back in the mode it came in
    assert first["days"] == 4 and math.isfinite(first["rank_ic"]) and first["score"] == pytest.approx(-first["rank_ic"])
    assert metric(predictor) == first  # seeded: the same model scores the same


def random_forecaster(x, x_stamp, y_stamp):
    """Draws from torch's global generator, as a sampling model does. (B, P)"""
    noise = torch.randn(x.shape[0], y_stamp.shape[1], dtype=torch.float64).numpy()
    return x[:, -1:, 3] * (1.0 + 0.01 * noise)


def test_each_forecaster_is_seeded_right_before_it_runs(tmp_path, data):
    from finetune.qlib_test import forecast_all

    cfg = prepared(tmp_path, "seeds", data)
    split = load_split(split_path(cfg.data.dataset_path, "test"))
    cal = np.asarray(read_manifest(cfg.data.dataset_path)["calendar_ns"], dtype=np.int64)
    first = qf_first(cfg)
    three = forecast_all(cfg, {"seed0": random_forecaster, "seed1": random_forecaster, "seed7": random_forecaster,
                               "zeroshot": random_forecaster}, {"seed0": 0, "seed1": 1, "seed7": 7, "zeroshot": 0},
                         split, cal, first)
    one = forecast_all(cfg, {"seed7": random_forecaster, "zeroshot": random_forecaster}, {"seed7": 7, "zeroshot": 0},
                       split, cal, first)
    pd.testing.assert_frame_equal(three["zeroshot"], one["zeroshot"])  # whatever ran before it
    pd.testing.assert_frame_equal(three["seed7"], one["seed7"])  # a seed's draws depend on its value only
    pd.testing.assert_frame_equal(three["seed0"], one["zeroshot"])
    assert not np.allclose(three["seed0"]["last"], three["seed1"]["last"])


def test_no_position_is_held_after_an_instruments_last_bar(tmp_path, data):
    from finetune.qlib_test import data_ends, run_backtest, summary_table, universe_warnings

    ended = sorted(data)[1]
    last_day = pd.Timestamp("2022-05-13")
    cut = {s: (df[pd.to_datetime(df["timestamps"]) <= last_day] if s == ended else df) for s, df in data.items()}
    qdir = tmp_path / "qlib"
    build_qlib_provider(cut, qdir, universe="csi300", benchmark="SH000300")
    cfg = config(tmp_path, qdir)
    init_qlib(cfg)
    from qlib.data import D

    days = pd.DatetimeIndex(D.calendar(start_time="2022-04-01", end_time="2022-06-10"))
    idx = pd.MultiIndex.from_product([days, sorted(cut)], names=["datetime", "instrument"])
    score = pd.Series([1.0 if i == ended else 0.0 for _, i in idx], index=idx)  # always ranked first
    assert data_ends(sorted(cut), days[-1]) == {ended: last_day}
    report, holdings = run_backtest(cfg, score, days[1], days[-2])
    assert any(ended in held for day, held in holdings.items() if day < last_day)
    assert not any(ended in held for day, held in holdings.items() if day >= last_day)
    assert report["turnover"].loc[last_day] > 0  # sold on its last bar, at that day's price
    # the report's warnings name it; two or three instruments get no t-statistic
    small = pd.MultiIndex.from_product([days, ["A", "B", "C"]], names=["datetime", "instrument"])
    warned = universe_warnings(small, {ended: last_day})
    assert "no t-statistic" in warned[0] and f"{ended} (2022-05-13)" in warned[1]
    head = {"IC": 0.1, "ICIR": 1.0, "IC_t": 3.0, "RankIC": 0.1, "RankICIR": 1.0, "days": 50}
    assert math.isnan(summary_table({"last": {"horizon": 1, "headline": head}}, t_ok=False).loc["last", "t_IC"])


def test_a_second_backtest_into_a_locked_results_folder_refuses_and_writes_nothing(tmp_path, capsys):
    """Two qlib-backtest runs into one folder: the second refuses at once (exit 5 naming the setting and the holder),
    before any work, and leaves the folder as the first run has it."""
    from finetune import cli
    from finetune.utils.safety import RunLock

    out = tmp_path / "backtest"
    args = ["qlib-backtest", "--config", "configs/qlib_demo.yaml", "--set", f"paths.backtest_result_path={out}"]
    with RunLock(tmp_path, name=".backtest.lock", key="paths.backtest_result_path"):  # the first run, still going
        assert cli.main(args) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "paths.backtest_result_path" in err and "Traceback" not in err
    assert not out.exists()
    out.mkdir()  # a folder of the user's, not a backtest's: refused, as it would be replaced whole
    (out / "notes.txt").write_text("mine")
    assert cli.main([*args, "--set", f"data.dataset_path={tmp_path / 'none'}"]) == EXIT_CONFIG
    assert "paths.backtest_result_path" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"
