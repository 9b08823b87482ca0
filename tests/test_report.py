"""report.html (finetune/evaluation/report.py): written by `kronos forecast`, rebuilt identically by `kronos report`,
self-contained, carrying the run's own numbers; pages of walk-forward, Qlib and tune folders from their files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from finetune import cli
from finetune.evaluation import report
from finetune_csv import forecast
from finetune_csv.config import load
from model.errors import EXIT_DATA, EXIT_PATH
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


def other_runs(root: Path) -> dict[str, Path]:
    """Folders of a CSV walk-forward, a Qlib backtest, a Qlib walk-forward and a tune, with hand-written files in the
    shapes those commands write (Qlib is not installed in every test environment; kronos tune may not be merged)."""
    wf, bt, qwf, tuned = root / "walk_forward", root / "backtest", root / "qlib_wf" / "walk_forward", root / "tuned"
    per_fold = [{"fold": k, "mean": -0.01 * k, "ci_low": -0.02, "ci_high": 0.01, "windows": 4} for k in range(2)]
    score = {"crps": 0.1, "mae": 0.2, "cov50": 0.5, "cov80": 0.8, "direction": 0.5}
    (wf / "fold_0" / "basemodel").mkdir(parents=True)
    (wf / "fold_0" / "basemodel" / "metrics.jsonl").write_text(
        json.dumps({"kind": "train", "step": 1, "loss": 2.0, "lr": 1e-3}) + "\n{torn")
    (wf / "report.json").write_text(json.dumps({
        "verdict": "no_evidence", "verdict_reason": "contains 0", "scores": {"finetuned": score, "zero_shot": score},
        "folds": [{"fold": k, "test_start": f"2024-01-0{k + 1}", "test_end": "x", "windows": {"test": 4},
                   "scores": {"finetuned": score}, "before_pretraining_cutoff": False} for k in range(2)],
        "paired": {"finetuned_vs_zero_shot": {"crps": {"per_fold": per_fold, "mean": -0.005, "reason": "r"}}},
        "best": {"line": "best by CRPS: finetuned"}}))
    pd.DataFrame({"candidate": ["finetuned", "finetuned", "zero_shot"], "window_start": ["a", "b", "a"],
                  "crps": [1.0, 2.0, 5.0], "in_verdict": [True, True, True]}).to_csv(wf / "windows.csv", index=False)

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

    (tuned / "tune").mkdir(parents=True)
    (tuned / "tune" / "report.json").write_text(json.dumps(
        {"trials": [{"number": k, "score": 0.3 - 0.01 * k, "params": {"lr": k}} for k in range(4)],
         "selected": {"lr": 1e-3}, "inner": 0.28, "outer": 0.31, "pbo": 0.2, "verdict": "keep"}))
    return {"walk_forward": wf, "qlib": bt, "qlib_walk_forward": qwf, "tune": tuned}


def test_walk_forward_qlib_and_tune_folders_get_their_sections(tmp_path):
    runs = other_runs(tmp_path)
    for kind, folder in runs.items():
        page = report.collect(folder)
        assert page["kind"] == kind
        if kind in ("walk_forward", "qlib_walk_forward", "tune"):
            assert page[kind] == json.loads((folder / ("tune" if kind == "tune" else "") / "report.json").read_text())
    wf = report.collect(runs["walk_forward"])
    assert wf["walk_forward_cumulative"]["finetuned"]["v"] == [1.0, 3.0]  # by date, summed over time
    assert [s["name"] for s in wf["training"]] == ["fold_0/basemodel"] and wf["training"][0]["train"][0]["loss"] == 2

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
