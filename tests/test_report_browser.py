"""report.html in a real browser: Debian's chromium driven by Playwright's Python package (never `playwright install`).

On a forecast run's page: no network request beyond the page's own file, no console error, every headline number
(best by CRPS, each paired difference and its interval, coverage and its interval) equal to metrics.json's, every
chart drawn with a non-zero size, and the window picker changing the drawn window. On every page: nothing wider than
a 1,400 px viewport, the run's name (not its path) in the header. Skipped, saying why, without playwright or chromium
(scripts/test.sh installs both when it runs as root on Debian).

    KRONOS_REPORT_RUN=outputs/csv_demo/forecast            check the demo's page instead of a tiny run's
    KRONOS_REPORT_SCREENSHOT=docs/images/report_demo.png   and save the screenshot the README shows
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest

from finetune.evaluation.report import write_report
from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune_csv import forecast
from finetune_csv.config import load
from model.calibration import write_calibration
from tests.test_csv_eval import make_run
from tests.test_report import other_runs

pytestmark = pytest.mark.slow
CHROMIUM = os.environ.get("KRONOS_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install "
                                     "playwright; scripts/test.sh does): the browser test of report.html is skipped")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium as root on Debian; scripts/test.sh does): "
                    "the browser test of report.html is skipped")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    if os.environ.get("KRONOS_REPORT_RUN"):
        run = Path(os.environ["KRONOS_REPORT_RUN"])
        write_report(run)  # the page of the run's files as they are now
        return run
    root = tmp_path_factory.mktemp("run")
    config = make_run(root, n_bars=(1000, 1000))
    # daily bars: each test window on its own date, enough dates (33) for the paired tests' intervals
    write_csv_folder(generate_ohlcv(n_series=2, n_bars=1000, freq="1D", seed=3), root / "data")
    # a stored calibration (bands 4x wider at 80%) that the tiny model's held-out coverage tests against nominal
    write_calibration(root / "out/ev/basemodel/best_model/kronos_predictor.json", {
        "method": "conformal", "space": "band", "levels": [0.5, 0.8], "margins": [[0.0] * 6, [3.0] * 6], "windows": 40})
    cfg = load(config)
    forecast.run_forecast(cfg)
    return cfg.base_dir / "forecast"


def number(text: str) -> float:
    return float(text.replace("\u2212", "-").replace("+", ""))


WIDER = """() => { const w = document.documentElement.clientWidth;
  return [...document.querySelectorAll("body *")].filter(e => e.getBoundingClientRect().right > w + 0.5)
    .map(e => `${e.tagName}#${e.id}.${e.getAttribute("class")}`); }"""


def open_page(browser, url: str):
    """The page at 1,400 px, with the requests it made and the errors it logged."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_load_state("load")
    return page, requests, errors


def check_layout(page, run: Path) -> None:
    """No element wider than the viewport, the run's name (its folder and output folder) in the header."""
    assert page.evaluate(WIDER) == [] and page.evaluate("document.documentElement.scrollWidth") <= 1400
    assert page.inner_text("#run") == f"{run.resolve().parent.name}/{run.resolve().name}"
    assert str(run.resolve().parent) not in page.inner_text("header") + page.title()


def test_the_page_in_chromium_shows_the_runs_numbers_offline(browser, run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    url = (run_dir / "report.html").resolve().as_uri()
    page, requests, errors = open_page(browser, url)
    page.wait_for_selector("#forecast-chart .main-svg")
    assert requests == [url] and errors == []
    check_layout(page, run_dir)

    # best by CRPS: every scored forecaster, ranked here from metrics.json independently of the page
    ft = metrics["finetuned"]
    crps = {k: metrics[k]["model"]["overall"]["crps"] for k in ("finetuned", "zero_shot", "ensemble") if metrics[k]}
    crps |= {k: ft[k]["overall"]["crps"] for k in ("persistence", "empirical", "seasonal_naive") if k in ft}
    best = min(crps, key=crps.get)
    assert page.get_attribute("#best b", "data-name") == best
    assert page.inner_text("#best .value") == f"{crps[best]:.5f}"
    assert page.locator("#ranking tbody tr").count() == len(crps)

    # each paired difference with its interval, or "none" where the run printed the reason instead
    tests = {("finetuned", k): t for k, t in (ft.get("versus") or {}).items()}
    tests |= {(k, "zero_shot"): metrics[f"{k}_vs_zero_shot"]["test"]["crps"] for k in ("finetuned", "ensemble")
              if metrics.get(f"{k}_vs_zero_shot")}
    assert tests and page.locator("#differences tbody tr").count() == len(tests)
    if not os.environ.get("KRONOS_REPORT_RUN"):  # the tiny run's differences have intervals (the demo's have none)
        assert any("interval [" in t["reason"] for t in tests.values())
    for (a, b), t in tests.items():
        cells = page.locator(f'#differences tr[data-a="{a}"][data-b="{b}"] td').all_inner_texts()
        assert number(cells[1]) == pytest.approx(t["mean"], rel=5e-3)
        if "interval [" in t["reason"]:
            low, high = map(number, re.findall(r"[-+]?[\d.]+(?:e[-+]?\d+)?", cells[2]))
            assert (low, high) == pytest.approx((t["ci_low"], t["ci_high"]), rel=5e-3)
        else:
            assert cells[2] == "none" and cells[3] in t["reason"]

    # coverage beside nominal, calibrated: calibrated - nominal with metrics.json's interval, the CLI's refit advice
    cal = metrics["calibration"]
    assert cal or os.environ.get("KRONOS_REPORT_RUN")  # the tiny run stores a calibration
    for level in (50, 80):
        cells = page.locator(f'#coverage tr[data-level="{level}"] td').all_inner_texts()
        expected = cal[f"cov{level}_calibrated"] if cal else ft["model"]["overall"][f"coverage_{level}"]
        assert number(cells[1]) == level / 100 and number(cells[3]) == pytest.approx(expected, abs=5e-4)
        if cal:
            test = cal[f"test_{level}"]
            assert number(cells[2]) == pytest.approx(cal[f"cov{level}_raw"], abs=5e-4)
            assert number(cells[4]) == pytest.approx(test["mean"], rel=5e-3)
            if test["ci_low"] is None:
                assert cells[5] == "none" and cells[6] in test["reason"]
            else:
                low, high = map(number, re.findall(r"[-+]?[\d.]+(?:e[-+]?\d+)?", cells[5]))
                assert (low, high) == pytest.approx((test["ci_low"], test["ci_high"]), rel=5e-3)
                assert cells[6].startswith(test["verdict"])  # "no_evidence" with what it could detect (issue 51)
                assert (test["verdict"] != "no_evidence") == ("detects only |difference| >=" not in cells[6])
    off = [f"{p}%" for p in (50, 80) if cal and cal[f"test_{p}"]["verdict"] != "no_evidence"]
    assert page.locator("#refit").count() == bool(off)
    if off:
        advice = page.inner_text("#refit")
        assert f"off nominal at {', '.join(off)}" in advice and "refit it" in advice
    # CRPS by forecast step: whole steps on the axis
    ticks = page.locator("#crps-horizon .xtick text").all_text_contents()
    assert ticks and all(t.isdigit() for t in ticks)

    # every chart drawn, with a size
    charts = page.locator(".js-plotly-plot")
    assert charts.count() >= 2
    for i in range(charts.count()):
        box = charts.nth(i).locator(".main-svg").first.bounding_box()
        assert box and box["width"] > 100 and box["height"] > 100

    # the window picker draws the window it names (its first forecast bar, as forecast.csv has it)
    table = pd.read_csv(run_dir / "forecast.csv")
    chart = page.locator("#forecast-chart")
    first = chart.get_attribute("data-window")
    options = page.locator("#window-picker option")
    assert options.count() >= 2
    target = options.nth(options.count() - 1).get_attribute("value")
    page.select_option("#window-picker", target)
    drawn = chart.get_attribute("data-window")
    assert drawn != first
    start = table.loc[table.window == int(drawn), "timestamps"].iloc[0]
    assert start in chart.locator(".gtitle").text_content()
    assert errors == [] and len(set(requests)) == 1

    if os.environ.get("KRONOS_REPORT_SCREENSHOT"):
        page.select_option("#window-picker", options.nth(min(2, options.count() - 1)).get_attribute("value"))
        bottom = page.locator("#forecasts").bounding_box()  # the scores and a forecast window: the README's view
        page.set_viewport_size({"width": 1280, "height": 1000})
        page.screenshot(path=os.environ["KRONOS_REPORT_SCREENSHOT"], full_page=True,
                        clip={"x": 0, "y": 0, "width": 1280, "height": bottom["y"] + bottom["height"] + 12})
    page.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return other_runs(tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("kind", ["walk_forward", "qlib", "qlib_walk_forward", "tune"])
def test_walk_forward_qlib_and_tune_pages_draw_without_errors(browser, runs, kind):
    folder = runs[kind]
    url = write_report(folder).resolve().as_uri()
    page, requests, errors = open_page(browser, url)
    assert requests == [url] and errors == []
    assert page.locator(f"section#{kind.replace('_', '-')}").count() == 1
    check_layout(page, folder)
    charts = page.locator(".js-plotly-plot .main-svg")
    assert charts.count() >= 1
    assert all(charts.nth(i).bounding_box()["width"] > 100 for i in range(charts.count()))
    text = page.inner_text("main")
    if kind == "qlib_walk_forward":
        assert "verdict: no_evidence" in text
    if kind == "qlib":
        assert "best by IC: mean" in text and "warning: w" in text
    page.close()


def test_walk_forward_page_draws_each_folds_interval_and_says_why_there_is_none(browser, runs):
    report = json.loads((runs["walk_forward"] / "report.json").read_text())
    per = report["paired"]["finetuned_vs_zero_shot"]["crps"]["per_fold"]
    assert [r["ci_low"] is None for r in per] == [True, False]  # fold 0: 8 dates, fold 1: 20
    page, _, errors = open_page(browser, write_report(runs["walk_forward"]).resolve().as_uri())
    for r in per:
        cell = page.locator(f'#folds tr[data-fold="{r["fold"]}"] td').all_inner_texts()[-2]
        if r["ci_low"] is None:
            assert cell.startswith("none") and "only 8 non-overlapping stretches" in cell
        else:
            low, high = map(number, re.findall(r"[-+]?[\d.]+(?:e[-+]?\d+)?", cell))
            assert (low, high) == pytest.approx((r["ci_low"], r["ci_high"]), rel=5e-3)
    # error bars: fold 1's and all folds' (the verdict's interval); fold 0 a mark without one
    drawn = page.evaluate("""() => document.getElementById("fold-chart").data.map(t => [t.name, t.x,
                             t.error_y ? t.error_y.array.length : 0])""")
    assert drawn == [["fold mean, 95% interval", ["fold 1"], 1],
                     ["fold mean (no interval: see the table)", ["fold 0"], 0],
                     ["all folds, 95% interval", ["all folds"], 1]]
    title = page.locator("#fold-chart .gtitle").bounding_box()
    chart = page.locator("#fold-chart").bounding_box()
    assert chart["x"] <= title["x"] and title["x"] + title["width"] <= chart["x"] + chart["width"]  # not clipped
    assert errors == []
    page.close()


def test_tune_page_formats_every_number_and_shows_trials_pbo_and_the_selection(browser, runs):
    report = json.loads((runs["tune"] / "tune" / "report.json").read_text())
    page, _, errors = open_page(browser, write_report(runs["tune"]).resolve().as_uri())
    assert errors == []
    text = page.inner_text("#tune")
    assert text.startswith("Tune") and "{" not in text  # no raw JSON
    for token in re.findall(r"\d[\d.]*(?:e[-+]?\d+)?", text):  # every number at most 4 significant digits
        digits = token.split("e")[0].replace(".", "").lstrip("0")
        assert "." not in token and "e" not in token or len(digits) <= 4, token
        assert "e" not in token or re.fullmatch(r"[\d.]+e[-+]\d\d", token), token  # 6.8e-05, as Python prints
    verdict = page.inner_text("#verdict")
    assert f"tuned vs zero-shot (the verdict): {report['verdict']}" in verdict and "tuned vs default: " in verdict
    assert f"PBO {report['pbo']:.2f}:" in page.inner_text("#pbo") and "below the median" in page.inner_text("#pbo")
    # the trials: one row each, the settings and inner score formatted, the failed one with its error
    rows = report["trials"]["list"]
    assert page.locator("#trials tbody tr").count() == len(rows) and page.locator("#trials-chart .main-svg").count()
    first = page.locator('#trials tr[data-trial="0"] td').all_inner_texts()
    assert first[2] == "6.8e-05" and first[3] == "1" and "the config as given" in first[-1]
    for r in rows:
        cells = page.locator(f'#trials tr[data-trial="{r["number"]}"] td').all_inner_texts()
        assert cells[1] == r["state"] and number(cells[2]) == pytest.approx(r["settings"]["predictor_training.lr"],
                                                                            rel=5e-3)
        assert cells[4] == "-" if r["value"] is None else number(cells[4]) == pytest.approx(r["value"], rel=5e-3)
        assert (r["error"] or "") in cells[-1]
    # the selected settings beside the config as given; inner vs outer
    for key, value in report["selected"]["settings"].items():
        assert number(page.locator(f'#selected tr[data-key="{key}"] td').all_inner_texts()[1]) == pytest.approx(
            value, rel=5e-3)
    inner_outer = page.locator("#inner-outer tbody tr td:nth-child(2)").all_inner_texts()
    expected = [report["inner"]["mean"], report["inner"]["default_mean"], report["inner"]["expected_best_null"],
                report["outer"]["tuned_vs_zero_shot"]["mean"], report["outer"]["tuned_vs_default"]["mean"]]
    assert [number(c) for c in inner_outer] == pytest.approx(expected, rel=5e-3)
    page.close()


def test_a_panel_files_series_are_shown_by_symbol(browser, tmp_path):
    """forecast.csv of one panel file's series (named panel.csv[AAPL] by finetune_csv/sources.py): the picker and
    the chart title say AAPL, the note names the file once."""
    stamps = pd.date_range("2024-01-01", periods=8, freq="D").astype(str)
    pd.concat([pd.DataFrame({"window": k, "series": name, "timestamps": stamps,
                             **{f"close_q{q}": 100.0 + q / 100 for q in (10, 25, 50, 75, 90)},
                             **{f"actual_{f}": 100.0 for f in ("open", "high", "low", "close")}})
               for k, name in enumerate(["panel.csv[AAPL]", "panel.csv[MSFT]"])]).to_csv(tmp_path / "forecast.csv",
                                                                                        index=False)
    page, _, errors = open_page(browser, write_report(tmp_path).resolve().as_uri())
    page.wait_for_selector("#forecast-chart .main-svg")
    assert page.locator("#series-picker option").all_inner_texts() == ["AAPL", "MSFT"]
    assert page.locator("#forecast-chart .gtitle").text_content().startswith("AAPL, window 0")
    assert "the series of panel.csv" in page.inner_text("#forecasts") and errors == []
    page.close()
