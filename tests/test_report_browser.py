"""report.html in a real browser: Debian's chromium driven by Playwright's Python package (never `playwright install`).

On a forecast run's page: no network request beyond the page's own file, no console error, every headline number
(best by CRPS, each paired difference and its interval, coverage) equal to metrics.json's, every chart drawn with a
non-zero size, and the window picker changing the drawn window. Skipped, saying why, without playwright or chromium
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
    cfg = load(config)
    forecast.run_forecast(cfg)
    return cfg.base_dir / "forecast"


def number(text: str) -> float:
    return float(text.replace("\u2212", "-").replace("+", ""))


def test_the_page_in_chromium_shows_the_runs_numbers_offline(browser, run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    url = (run_dir / "report.html").resolve().as_uri()
    page.goto(url)
    page.wait_for_selector("#forecast-chart .main-svg")
    assert requests == [url] and errors == []

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

    # coverage beside nominal with its sampling error
    cal = metrics["calibration"]
    for level in (50, 80):
        cells = page.locator(f'#coverage tr[data-level="{level}"] td').all_inner_texts()
        expected = cal[f"cov{level}_calibrated"] if cal else ft["model"]["overall"][f"coverage_{level}"]
        assert number(cells[1]) == level / 100 and number(cells[3]) == pytest.approx(expected, abs=5e-4)
        if cal:
            assert number(cells[2]) == pytest.approx(cal[f"cov{level}_raw"], abs=5e-4)
            assert number(cells[4][1:]) == pytest.approx(cal[f"sampling_error_{level}"], abs=5e-4)

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
        page.screenshot(path=os.environ["KRONOS_REPORT_SCREENSHOT"], full_page=True,
                        clip={"x": 0, "y": 0, "width": 1280, "height": bottom["y"] + bottom["height"] + 12})
    page.close()


@pytest.mark.parametrize("kind", ["walk_forward", "qlib", "qlib_walk_forward", "tune"])
def test_walk_forward_qlib_and_tune_pages_draw_without_errors(browser, tmp_path, kind):
    folder = other_runs(tmp_path)[kind]
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    url = write_report(folder).resolve().as_uri()
    page.goto(url)
    page.wait_for_load_state("load")
    assert requests == [url] and errors == []
    assert page.locator(f"section#{kind.replace('_', '-')}").count() == 1
    charts = page.locator(".js-plotly-plot .main-svg")
    assert charts.count() >= 1
    assert all(charts.nth(i).bounding_box()["width"] > 100 for i in range(charts.count()))
    text = page.inner_text("main")
    if kind in ("walk_forward", "qlib_walk_forward"):
        assert "verdict: no_evidence" in text
    if kind == "qlib":
        assert "best by IC: mean" in text and "warning: w" in text
    if kind == "tune":
        assert "0.20000" in text and "0.31000" in text  # PBO and the outer score, from tune/report.json
    page.close()
