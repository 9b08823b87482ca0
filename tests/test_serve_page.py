"""The page `kronos serve` answers at / in a real browser: Debian's chromium driven by Playwright's Python package
(never `playwright install`), against the app served by uvicorn on 127.0.0.1 in this process. Upload a CSV, pick the
series, forecast: the candles, the median and the band drawn, the CSV downloaded holds the served numbers, no
console error, no request beyond the server. Skipped, saying why, without playwright or chromium."""

from __future__ import annotations

import csv
import socket
import threading
import time

import httpx
import pandas as pd
import pytest
import uvicorn

from finetune_csv.serve import create_app
from tests.test_report_browser import ARGS, CHROMIUM
from tests.test_serve import folder, frame  # noqa: F401 - the tiny model folder fixture

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(folder):  # noqa: F811
    app = create_app({"run": (str(folder), None, "cpu")})
    app.state.load_all()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.started, "uvicorn did not start in 30 s"
    yield url
    srv.should_exit = True
    thread.join(30)


def test_the_page_uploads_forecasts_draws_and_downloads_offline(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: the page test skips")
    if not __import__("pathlib").Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium at {CHROMIUM}: the page test skips")
    candles = pd.concat([frame(60, 0).assign(id="AAA"), frame(50, 1).assign(id="BBB")])
    candles[["id", "timestamps", "open", "high", "low", "close", "volume"]].to_csv(tmp_path / "c.csv", index=False)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
            requests, errors = [], []
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server + "/", timeout=30_000)
            page.fill("#paste", "id,timestamps,open,high,low,close\nX,2024-01-02,1,2,0.5,1.5\nY,2024-01-02,1,2,0.5,1.5")
            assert page.eval_on_selector_all("#series option", "os => os.map(o => o.value)") == ["X", "Y"]
            page.set_input_files("#file", str(tmp_path / "c.csv"))
            page.wait_for_function("document.querySelectorAll('#series option').length == 2", timeout=10_000)
            page.select_option("#series", "BBB")
            page.fill("#horizon", "5")
            page.fill("#quantiles", "0.1,0.5,0.9")
            page.click("#go")
            page.wait_for_selector("#chart .main-svg", timeout=30_000)
            traces = page.evaluate("document.getElementById('chart').data.map(t => [t.type || 'scatter', t.name,"
                                   " (t.x || []).length])")
            assert traces == [["candlestick", "BBB", 50], ["scatter", "q0.1", 5], ["scatter", "q0.9", 5],
                              ["scatter", "median", 5]]
            assert page.locator("#chart .main-svg").first.bounding_box()["height"] > 300
            with page.expect_download(timeout=10_000) as download:
                page.click("#download")
            rows = list(csv.DictReader(open(download.value.path(), encoding="utf-8")))
        finally:
            browser.close()
    served = httpx.post(server + "/v1/forecast", timeout=60, json={"horizon": 5, "quantiles": [0.1, 0.5, 0.9],
                        "series": [{"id": "BBB", **{c: frame(50, 1)[c].astype(str if c == "timestamps" else float)
                                                    .tolist() for c in frame().columns}}]}).json()["outputs"][0]
    assert [r["timestamps"] for r in rows] == served["timestamps"]
    assert [float(r["close_q0.9"]) for r in rows] == pytest.approx(served["quantiles"]["0.9"]["close"], rel=1e-6)
    assert errors == [] and {r.split("/")[2] for r in requests} == {server.split("/")[2]}
    assert sum(r.endswith("/v1/forecast") for r in requests) == 1
