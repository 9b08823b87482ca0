"""report.html (finetune/evaluation/report.py): written by `kronos forecast`, rebuilt identically by `kronos report`,
self-contained, carrying the run's own numbers; pages of walk-forward, Qlib and tune folders from their files."""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from finetune import cli
from finetune.evaluation import report
from finetune.evaluation.statistics import paired_test, session_test
from finetune.utils import tune
from finetune_csv import forecast
from finetune_csv import walk_forward as wf
from finetune_csv.config import load
from model.errors import EXIT_DATA, EXIT_PATH, DataError
from tests.test_csv_eval import make_run
from tests.test_packaging import PYPROJECT

STAMP = re.compile(r"<span id=generated>[^<]*</span>")


def page_data(html: str) -> dict:
    """The JSON the page draws from (the <script id="page-data"> block)."""
    text = re.search(r'<script id="page-data" type="application/json">(.*?)</script>', html, re.S)[1]
    return json.loads(text.replace("<\\/", "</"))


@pytest.fixture(scope="module")
def forecast_run(tmp_path_factory) -> Path:
    """A held-out forecast of a tiny run (two series, zero-shot compared, 8 samples): the folder kronos forecast
    wrote, report.html included."""
    root = tmp_path_factory.mktemp("run")
    cfg = load(make_run(root))
    forecast.run_forecast(cfg)
    return cfg.base_dir / "forecast"


@pytest.mark.slow  # a forecast of a tiny run (~20 s on a busy CPU)
def test_forecast_writes_a_self_contained_page_with_the_runs_numbers(forecast_run):
    html = (forecast_run / "report.html").read_text(encoding="utf-8")
    assert len(html.encode()) < 8 * 2**20
    # nothing loaded from elsewhere: no external script, style, link or image
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", html, re.I)
    data = page_data(html)
    metrics = json.loads((forecast_run / "metrics.json").read_text())
    assert data["kind"] == "forecast" and data["metrics"] == metrics  # the file itself, not a recomputation
    table = pd.read_csv(forecast_run / "forecast.csv")
    windows = data["forecast"]["windows"]
    assert len(windows) == table["window"].nunique() == metrics["windows"]
    first = table[table.window == windows[3]["window"]]
    assert windows[3]["forecast"]["close_q50"] == pytest.approx(first["close_q50"].tolist(), rel=1e-6)  # 7 digits
    assert windows[3]["actual"]["actual_close"] == pytest.approx(first["actual_close"].tolist(), rel=1e-6)
    # the context bars end right before the window's first forecast bar: lookback 24, so min(24, 3 x 6) bars
    ctx = windows[3]["context"]
    assert len(ctx["close"]) == 18 and pd.Timestamp(ctx["timestamps"][-1]) < pd.Timestamp(first["timestamps"].iloc[0])
    stages = {s["name"]: s for s in data["training"]}
    assert "basemodel" not in stages  # the tiny run saved a model but never trained: no metrics.jsonl


@pytest.mark.slow  # a forecast of a tiny run (~20 s on a busy CPU)
def test_kronos_report_rebuilds_the_same_page_apart_from_its_timestamp(forecast_run, capsys):
    written = (forecast_run / "report.html").read_text(encoding="utf-8")
    context = (forecast_run / "context.csv").read_bytes()
    (forecast_run / "report.html").unlink()
    assert cli.main(["report", str(forecast_run)]) == 0
    rebuilt = (forecast_run / "report.html").read_text(encoding="utf-8")
    assert len(STAMP.findall(written)) == 1 and STAMP.sub("", written) == STAMP.sub("", rebuilt)
    assert (forecast_run / "context.csv").read_bytes() == context  # a rebuild reads, it does not rewrite
    assert "written:" in capsys.readouterr().out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a forecast of a tiny run (~20 s on a busy CPU)
def test_kronos_report_refuses_a_sealed_folder_with_files_the_seal_does_not_list(forecast_run, tmp_path, capsys):
    """The audit's reproduction: metrics.json edited and its SHA256SUMS line deleted; a foreign extra.csv dropped in.
    Each is exit 3 naming the file, and the folder is left as it was (not rebuilt, not sealed again)."""
    edited, extra = tmp_path / "edited", tmp_path / "extra"
    for folder in (edited, extra):
        shutil.copytree(forecast_run, folder)
    metrics = json.loads((edited / "metrics.json").read_text())
    metrics["windows"] += 1
    (edited / "metrics.json").write_text(json.dumps(metrics))
    sums = (edited / "SHA256SUMS").read_text().splitlines(keepends=True)
    (edited / "SHA256SUMS").write_text("".join(line for line in sums if not line.endswith("  metrics.json\n")))
    (extra / "extra.csv").write_text("a,b\n1,2\n")
    for folder, name in ((edited, "metrics.json"), (extra, "extra.csv")):
        before = _files(folder)
        assert cli.main(["report", str(folder)]) == EXIT_DATA
        err = capsys.readouterr().err
        assert err.startswith(f"error: {folder / name} is not listed in {folder / 'SHA256SUMS'}"), err
        assert "Traceback" not in err and _files(folder) == before
    assert cli.main(["report", str(forecast_run)]) == 0  # the untouched folder still rebuilds


@pytest.mark.slow  # a forecast of a tiny run (~20 s on a busy CPU)
def test_future_forecast_page_has_one_window_per_series_with_its_context(tmp_path):
    cfg = load(make_run(tmp_path, zero_shot=None))
    table = forecast.run_future(cfg)
    data = page_data((cfg.base_dir / "future" / "report.html").read_text(encoding="utf-8"))
    assert data["kind"] == "future" and data["forecast"]["future"]
    assert [w["series"] for w in data["forecast"]["windows"]] == list(table["series"].unique())
    for w in data["forecast"]["windows"]:
        assert "actual" not in w and pd.Timestamp(w["context"]["timestamps"][-1]) < pd.Timestamp(
            w["forecast"]["timestamps"][0])


def test_report_on_a_folder_without_run_files_is_one_path_error(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == EXIT_PATH
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.json" in err and "Traceback" not in err
    assert not (tmp_path / "report.html").exists()


def tune_study(folder: Path) -> dict:
    """tune/report.json as `kronos tune` writes it, by the study engine itself (finetune/utils/tune.py: Optuna, the
    trial table, PBO, the report) on a stand-in objective instead of training: 8 trials of lr (log) and temperature,
    trial 0 the config as given (lr 6.8e-05), trial 3 failing with a user error; 24 inner dates, 40 judged ones."""
    pytest.importorskip("optuna")
    tc = tune.TuneConfig(n_trials=8, heartbeat_seconds=5, space={
        "predictor_training.lr": {"low": 1e-5, "high": 1e-3, "log": True},
        "forecast.temperature": {"low": 0.5, "high": 1.5}})
    inner = pd.date_range("2024-01-01", periods=24, freq="B")

    def objective(params: dict, number: int) -> dict:  # trial - zero_shot CRPS per inner date: lr near 1e-4 helps
        if number == 3:
            raise DataError("the trial's data.lookback leaves no window")
        noise = np.random.default_rng(number).normal(0, 2e-4, len(inner))
        gap = 1e-4 * abs(np.log10(params["predictor_training.lr"]) + 4)
        return {str(d.date()): gap + e for d, e in zip(inner, noise)}

    args = argparse.Namespace(worker=False, workers=1, config="tune.yaml", set=[])
    given = {"predictor_training": {"lr": 6.8e-05}, "forecast": {"temperature": 1.0}}
    found = tune.run(folder, tc, {"space": tc.space}, ["judged"], given, objective, args, "tune", paired_test)
    judged, rng = pd.date_range("2024-03-01", periods=40, freq="B"), np.random.default_rng(1)
    outer = {f"tuned_vs_{o}": session_test(rng.normal(m, 4e-4, 40), judged, what=f"CRPS tuned - {o}")
             for o, m in (("zero_shot", 3e-4), ("default", 0.0))}
    frame = pd.DataFrame({"fold": 0, "series": "A", "window_start": np.tile(judged, 3),
                          "candidate": np.repeat(["tuned", "default", "zero_shot"], 40),
                          "crps": np.r_[rng.normal(0.0093, 4e-4, 40), rng.normal(0.0092, 4e-4, 40),
                                        np.full(40, 0.009)]})
    return tune.write_report(folder, found, outer, wf.best_candidate(frame), holdout=[
        {"test_start": "2024-03-01", "test_end": "2024-04-25"}], scores={"tuned": 0.0093})


def other_runs(root: Path) -> dict[str, Path]:
    """Folders of a CSV walk-forward, a Qlib backtest, a Qlib walk-forward and a tune, with files in the shapes those
    commands write: the walk-forward's paired tests and the tune report by their writers on stand-in scores, the rest
    by hand (Qlib is not installed in every test environment)."""
    wf_dir, bt, qwf, tuned = root / "walk_forward", root / "backtest", root / "qlib_wf" / "walk_forward", root / "tuned"
    score = {"crps": 0.1, "mae": 0.2, "cov50": 0.5, "cov80": 0.8, "direction": 0.5}
    (wf_dir / "fold_0" / "basemodel").mkdir(parents=True)
    (wf_dir / "fold_0" / "basemodel" / "metrics.jsonl").write_text(
        json.dumps({"kind": "train", "step": 1, "loss": 2.0, "lr": 1e-3}) + "\n{torn")
    # windows of a panel file's two series: fold 0 on 8 dates (no interval), fold 1 on 20 (an interval)
    days = [pd.date_range("2024-01-01", periods=8, freq="B"), pd.date_range("2024-02-01", periods=20, freq="B")]
    rng = np.random.default_rng(0)
    windows = pd.concat([pd.DataFrame({"fold": k, "series": np.repeat(["panel.csv[AAPL]", "panel.csv[MSFT]"], len(d)),
                                       "window_start": np.tile(d, 2), "candidate": c, "in_verdict": True,
                                       "crps": rng.normal(0.01 + 0.002 * (c == "zero_shot"), 0.001, 2 * len(d)),
                                       "mae": rng.normal(0.02, 0.001, 2 * len(d))})
                         for k, d in enumerate(days) for c in ("finetuned", "zero_shot", "persistence")])
    paired = wf.paired_from_windows(windows)
    (wf_dir / "report.json").write_text(json.dumps({
        "verdict": paired["crps"]["verdict"], "verdict_reason": paired["crps"]["reason"],
        "scores": {"finetuned": score, "zero_shot": score},
        "folds": [{"fold": k, "test_start": str(d[0].date()), "test_end": str(d[-1].date()),
                   "windows": {"test": 2 * len(d)}, "scores": {"finetuned": score}, "before_pretraining_cutoff": False}
                  for k, d in enumerate(days)],
        "paired": {"finetuned_vs_zero_shot": paired}, "best": wf.best_candidate(windows)}))
    windows.to_csv(wf_dir / "windows.csv", index=False)

    bt.mkdir()
    (bt / "report.json").write_text(json.dumps({
        "summary": {"mean": {"h": 1, "IC": 0.05}, "momentum": {"h": 1, "IC": 0.01}}, "benchmark": "SH000300",
        "signals": {"mean": {"horizon": 1}, "momentum": {"horizon": 1}}, "forecast_days": ["2022-03-31", "x"],
        "backtest_period": ["2022-04-01", "x"], "label": "close", "instruments": 4, "warnings": ["w"],
        "best": {"line": "best by IC: mean"}}))
    days = pd.date_range("2022-04-01", periods=5, freq="B")
    rng = np.random.default_rng(0)
    pd.DataFrame({"datetime": days, "mean_return": rng.normal(0, 0.01, 5), "mean_cost": 0.001, "mean_turnover": 0.2,
                  "momentum_return": 0.0, "momentum_cost": 0.0, "momentum_turnover": 0.1,
                  "bench": rng.normal(0, 0.01, 5)}).to_csv(bt / "backtest_daily.csv", index=False)
    pd.DataFrame({"datetime": np.repeat(days, 4), "instrument": list("abcd") * 5, "mean": rng.normal(size=20),
                  "momentum": rng.normal(size=20), "label_1": rng.normal(size=20)}).to_csv(bt / "signals.csv",
                                                                                          index=False)
    pd.DataFrame({"signal": ["mean", "mean"], "horizon": [1, 2], "ic": [0.05, 0.03], "rank_ic": [0.04, 0.02],
                  "ic_t_nw": [1.0, 0.5], "long_short": [0.0, 0.0]}).to_csv(bt / "ic_decay.csv", index=False)

    qwf.mkdir(parents=True)
    bt_stats = {"excess_return_with_cost": {"annualized_return": 0.1, "information_ratio": 1.0, "max_drawdown": -0.1},
                "turnover_mean": 0.2, "cost_ann": 0.01}
    (qwf / "report.json").write_text(json.dumps({
        "verdict": "no_evidence", "reason": "r", "signal": "mean", "horizon": 1, "benchmark": "SH000300",
        "periods": [{"period": k, "test_start": f"2022-0{k + 1}-01", "IC_finetuned": 0.01 * k, "IC_zero_shot": 0.0}
                    for k in range(3)], "backtest": {"finetuned": bt_stats, "zero_shot": bt_stats}}))

    tune_study(tuned / "tune")
    return {"walk_forward": wf_dir, "qlib": bt, "qlib_walk_forward": qwf, "tune": tuned}


def test_walk_forward_qlib_and_tune_folders_get_their_sections(tmp_path):
    runs = other_runs(tmp_path)
    for kind, folder in runs.items():
        page = report.collect(folder)
        assert page["kind"] == kind
        if kind in ("walk_forward", "qlib_walk_forward", "tune"):
            assert page[kind] == json.loads((folder / ("tune" if kind == "tune" else "") / "report.json").read_text())
    walk = report.collect(runs["walk_forward"])
    rows = pd.read_csv(runs["walk_forward"] / "windows.csv")
    by_date = rows[rows.candidate == "finetuned"].groupby("window_start")["crps"].mean().sort_index()
    assert walk["walk_forward_cumulative"]["finetuned"]["v"] == pytest.approx(by_date.cumsum().tolist())  # over time
    assert [s["name"] for s in walk["training"]] == ["fold_0/basemodel"]
    assert walk["training"][0]["train"][0]["loss"] == 2
    assert walk["run"] == f"{tmp_path.name}/walk_forward"  # the run's name, never the absolute path

    q = report.collect(runs["qlib"])["qlib"]
    daily = pd.read_csv(runs["qlib"] / "backtest_daily.csv")
    excess = (daily.mean_return - daily.mean_cost - daily.bench).cumsum()  # as cumulative_return.png sums it
    assert q["daily"]["excess"]["mean"] == pytest.approx(excess.tolist())
    signals = pd.read_csv(runs["qlib"] / "signals.csv")
    day0 = signals[signals.datetime == signals.datetime.min()]
    assert q["ic_by_date"]["mean"]["ic"][0] == pytest.approx(day0["mean"].corr(day0["label_1"]))
    assert q["decay"]["mean"]["ic"] == [0.05, 0.03]


def test_the_template_ships_with_the_package():
    assert report.TEMPLATE.name in PYPROJECT["tool"]["setuptools"]["package-data"]["finetune.evaluation"]
    assert any(d.startswith("plotly") for d in PYPROJECT["project"]["dependencies"])  # no extra for a page


def test_windows_beyond_the_pages_budget_are_thinned_evenly(tmp_path, monkeypatch):
    """More window data than the page's budget (here 100 kB; 2 MB by default, beside Plotly's 4.6 MB): evenly spaced
    windows, the first and last kept, the total said."""
    monkeypatch.setattr(report, "WINDOW_BYTES", 100_000)
    n, horizon, rng = 200, 16, np.random.default_rng(0)
    stamps = pd.date_range("2020-01-01", periods=n * horizon, freq="h").astype(str)
    close = 100 + rng.normal(size=n * horizon).cumsum()
    fc = pd.DataFrame({"window": np.repeat(np.arange(n), horizon), "series": "A", "timestamps": stamps,
                       **{f"close_q{q}": close + q / 100 for q in (10, 25, 50, 75, 90)},
                       **{f"actual_{f}": close for f in ("open", "high", "low", "close")}})
    fc.to_csv(tmp_path / "forecast.csv", index=False)
    ctx = fc.loc[np.tile(np.arange(3 * horizon), n)].assign(window=np.repeat(np.arange(n), 3 * horizon))
    ctx.rename(columns={f"actual_{f}": f for f in ("open", "high", "low", "close")}).to_csv(
        tmp_path / "context.csv", index=False)
    shown = report.collect(tmp_path)["forecast"]
    assert shown["total"] == n and 5 < len(shown["windows"]) < n
    assert len(json.dumps(shown["windows"])) <= 100_000
    picked = [w["window"] for w in shown["windows"]]
    assert picked[0] == 0 and picked[-1] == n - 1
    assert np.ptp(np.diff(picked)) <= 1  # evenly spaced


def screen(text: str) -> list[str]:
    """The lines a terminal shows for `text`: each carriage return starts the line again, overwriting it."""
    lines = []
    for line in text.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown.rstrip())
    return lines


def test_tune_log_lines_never_share_a_line_with_its_progress_bar(tmp_path, capsys):
    from finetune.utils.errors import setup_logging

    setup_logging()  # kronos's console handler, on this test's stderr
    try:
        tune_study(tmp_path / "tune")
    finally:
        for handler in [h for h in logging.getLogger().handlers if getattr(h, "_kronos_setup", False)]:
            logging.getLogger().removeHandler(handler)
    lines = screen(capsys.readouterr().err)
    failed = [line for line in lines if "trial 3 failed" in line]
    assert failed and all("tune tune-" not in line for line in failed)  # the log line alone
    assert any(re.match(r"tune tune-\w+: 100%.* 8/8", line) for line in lines)  # the bar on its own line, finished
