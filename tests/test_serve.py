"""kronos serve: every endpoint against the app (httpx's ASGI transport) with the tiny demo-sized models, the error
envelope and codes, equality with predict_df, batch invariance, reload with requests in flight, the key rule, the
refused folders, and one real `kronos serve` process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pandas as pd
import pytest

from finetune.cli import main as cli_main
from finetune_csv.journal import read_journal
from finetune_csv.serve import create_app, journal_served
from model import KronosPredictor, adaptive
from model.calibration import fit_calibration
from model.hub import weights_fingerprint
from tests.model_factory import tiny_models
from tests.readme_blocks import ROOT, readme_block

KEY = "s3cret"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A self-contained tiny predictor folder (tokenizer/ inside) with kronos_predictor.json."""
    root = tmp_path_factory.mktemp("model") / "run" / "best_model"
    tok, pred = tiny_models(0)
    pred.save_pretrained(root)
    tok.save_pretrained(root / "tokenizer")
    (root / "kronos_predictor.json").write_text('{"max_context": 64, "lookback": 48}')
    return root


def frame(n: int = 60, seed: int = 0) -> pd.DataFrame:
    r = np.random.default_rng(seed)
    c = 100 * np.exp(np.cumsum(r.normal(0, 0.01, n)))
    return pd.DataFrame({"timestamps": pd.date_range("2024-01-01", periods=n, freq="h"), "open": c,
                         "high": c * 1.01, "low": c * 0.99, "close": c, "volume": r.uniform(1, 2, n)})


def series(sid, n: int = 60, seed: int = 0) -> dict:
    f = frame(n, seed)
    return {"id": sid, "timestamps": f.timestamps.astype(str).tolist(),
            **{c: f[c].tolist() for c in ("open", "high", "low", "close", "volume")}}


def serve(folder, **kw):
    app = create_app({"run": (str(folder), None, "cpu")}, **kw)
    app.state.load_all()
    return app


async def call(app, method, url, key=None, **kw):
    headers = {**({"X-API-Key": key} if key else {}), **kw.pop("headers", {})}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.request(method, url, headers=headers, **kw)


def run(coro):
    return asyncio.run(coro)


def test_endpoints_forecast_equals_predict_df_and_metrics(folder):
    loading = create_app({"run": (str(folder), None, "cpu")})  # not loaded yet: live, not ready, forecasts wait
    assert run(call(loading, "GET", "/v2/health/live")).status_code == 200
    assert run(call(loading, "GET", "/v2/health/ready")).status_code == 503
    r = run(call(loading, "POST", "/v1/forecast", json={"series": [series("A")], "horizon": 2}))
    assert (r.status_code, r.json()["error"]["code"]) == (503, "not_ready")
    app = serve(folder)
    assert run(call(app, "GET", "/v2/health/live")).json() == {"live": True}
    assert run(call(app, "GET", "/v2/health/ready")).json() == {"ready": True}
    models = run(call(app, "GET", "/v1/models")).json()["models"]
    assert [(m["name"], m["max_context"], m["lookback"], m["calibration"]) for m in models] == [("run", 64, 48, None)]
    body = {"series": [series("A"), series("B", 40, 1)], "horizon": 5, "quantiles": [0.1, 0.9], "seed": 3}
    r = run(call(app, "POST", "/v1/forecast", json=body))
    assert r.status_code == 200
    out = r.json()
    assert out["sha256"] == models[0]["sha256"] and [o["status"] for o in out["outputs"]] == ["ok", "ok"]
    ref = KronosPredictor.from_pretrained(folder, device="cpu").predict_df(frame(40, 1), prediction_length=5,
                                                                            quantiles=[0.1, 0.9], seed=3)
    b = out["outputs"][1]
    assert b["timestamps"] == [t.isoformat() for t in ref["timestamps"]] and b["calibrated"] is False
    np.testing.assert_allclose(b["mean"]["close"], ref["close"], rtol=1e-5)
    np.testing.assert_allclose(b["quantiles"]["0.9"]["high"], ref["high_q90"], rtol=1e-5)
    text = run(call(app, "GET", "/metrics")).text
    assert 'kronos_requests_total{route="/v1/forecast",status="200"} 1.0' in text
    assert "kronos_batch_size_count 1.0" in text and 'kronos_series_total{status="ok"} 2.0' in text
    assert "kronos_queue_depth 0.0" in text
    page = run(call(app, "GET", "/"))
    assert page.status_code == 200 and "Plotly" in page.text and "/*PLOTLY_JS*/" not in page.text



def test_a_bad_series_errors_alone_and_limits_answer_one_envelope(folder):
    app = serve(folder, max_series=3, max_body_bytes=200_000)
    bad = series("bad")
    bad["close"][5] = None
    r = run(call(app, "POST", "/v1/forecast", json={"series": [series("A"), bad], "horizon": 3}))
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_series")
    assert r.json()["error"]["message"].startswith("series 'bad' has 1 value(s) NaN/inf, first in column 'close'")
    for body, status in [({"series": [series(i) for i in range(4)], "horizon": 3}, 422),
                         ({"series": [series("A")], "horizon": 65}, 422),
                         ({"series": [series("A")], "horizon": 3, "colour": 1}, 422),
                         ({"series": [series(i, 1000) for i in range(3)], "horizon": 3}, 413)]:
        r = run(call(app, "POST", "/v1/forecast", json=body))
        assert r.status_code == status and set(r.json()["error"]) == {"code", "message"}, r.text
    assert run(call(app, "GET", "/nowhere")).json()["error"]["code"] == "not_found"


def test_a_request_alone_and_among_16_others_gets_the_same_numbers(folder):
    app = serve(folder, max_batch_size=64, max_wait_ms=50)
    body = {"series": [series("A")], "horizon": 4, "quantiles": [0.5], "seed": 11}

    async def crowd():
        others = [call(app, "POST", "/v1/forecast", json={"series": [series(i, 60, i + 5)], "horizon": 4,
                                                          "quantiles": [0.5], "seed": i}) for i in range(16)]
        return (await asyncio.gather(call(app, "POST", "/v1/forecast", json=body), *others))[0]

    alone = run(call(app, "POST", "/v1/forecast", json=body)).json()["outputs"][0]
    among = run(crowd()).json()["outputs"][0]
    np.testing.assert_allclose(among["quantiles"]["0.5"]["close"], alone["quantiles"]["0.5"]["close"], rtol=1e-5)
    sizes = run(call(app, "GET", "/metrics")).text
    assert "kronos_batch_size_bucket{le=\"1.0\"} 1.0" in sizes  # the crowd was merged (not 18 passes of one)


def test_a_bad_request_among_good_ones_is_refused_alone_and_the_good_ones_share_one_pass(folder, monkeypatch,
                                                                                         caplog):
    """Four good requests and one bad (unreadable stamps; broken candles), at once: the bad ones answer 422 naming
    their series before joining a batch, the good ones 200 with each one's numbers alone, from ONE merged pass (the
    batch closes when its 4 series are in: no timing). A merged pass that still fails falls back to one pass per
    series, logged, with the same numbers."""
    alone = serve(folder)
    bodies = [{"series": [series(i, 60, i)], "horizon": 3, "quantiles": [0.5], "seed": i} for i in range(4)]
    want = [run(call(alone, "POST", "/v1/forecast", json=b)).json()["outputs"][0] for b in bodies]
    stamps, candles = series("s"), series("c")
    stamps["timestamps"][3] = "not a time"
    candles["low"][7] = candles["high"][7] * 2
    passes, real = [], KronosPredictor.predict_batch

    def counted(self, df_list, *args, **kw):
        passes.append(len(df_list))
        return real(self, df_list, *args, **kw)

    monkeypatch.setattr(KronosPredictor, "predict_batch", counted)
    app = serve(folder, max_batch_size=4, max_wait_ms=10_000)
    passes.clear()  # the warm-up's

    async def crowd():
        return await asyncio.gather(*(call(app, "POST", "/v1/forecast", json={**b, "series": [s]}) for b, s in
                                      [(bodies[0], stamps), (bodies[1], candles)]),
                                    *(call(app, "POST", "/v1/forecast", json=b) for b in bodies))

    bad_stamps, bad_candles, *good = run(crowd())
    assert passes == [4]
    assert (bad_stamps.status_code, bad_stamps.json()["error"]["code"]) == (422, "invalid_series")
    assert bad_stamps.json()["error"]["message"].startswith("series 's': ")
    assert "series 'c': column 'low' is" in bad_candles.json()["error"]["message"]
    for got, ref in zip(good, want):
        assert got.status_code == 200
        np.testing.assert_allclose(got.json()["outputs"][0]["quantiles"]["0.5"]["close"], ref["quantiles"]["0.5"][
            "close"], rtol=1e-5)

    def merged_fails(self, df_list, *args, **kw):  # e.g. out of memory at the merged size only
        if len(df_list) > 1:
            raise RuntimeError("out of memory")
        return counted(self, df_list, *args, **kw)

    monkeypatch.setattr(KronosPredictor, "predict_batch", merged_fails)
    passes.clear()

    async def good_only():
        return await asyncio.gather(*(call(app, "POST", "/v1/forecast", json=b) for b in bodies))

    again = run(good_only())
    assert passes == [1, 1, 1, 1] and "a merged pass of 4 series failed; forecasting each alone" in caplog.text
    assert [a.json()["outputs"][0]["quantiles"] for a in again] == [g.json()["outputs"][0]["quantiles"] for g in good]


def test_reload_with_requests_in_flight_and_the_new_sha(folder, tmp_path):
    app = serve(folder)
    before = run(call(app, "GET", "/v1/models")).json()["models"][0]["sha256"]
    _, other = tiny_models(5)
    other.save_pretrained(folder)  # a new finetune wrote the folder again

    async def both():
        flying = [call(app, "POST", "/v1/forecast", json={"series": [series(i)], "horizon": 3}) for i in range(6)]
        return await asyncio.gather(*flying, call(app, "POST", "/v1/models/run/reload"))

    *answers, reloaded = run(both())
    assert all(a.status_code == 200 for a in answers) and reloaded.status_code == 200
    after = run(call(app, "GET", "/v1/models")).json()["models"][0]["sha256"]
    assert after != before and after == reloaded.json()["sha256"]
    assert run(call(app, "POST", "/v1/models/nope/reload")).status_code == 404
    (folder / "SHA256SUMS").write_text("0" * 64 + "  model.safetensors\n")  # a folder whose seal does not verify
    try:
        refused = run(call(app, "POST", "/v1/models/run/reload"))
    finally:
        (folder / "SHA256SUMS").unlink()
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "reload_failed")
    assert run(call(app, "GET", "/v1/models")).json()["models"][0]["sha256"] == after  # the loaded one still serves


def test_the_key_rule(folder):
    app = serve(folder, api_key=KEY)
    assert run(call(app, "GET", "/v1/models")).status_code == 401
    assert run(call(app, "GET", "/v1/models", key="wrong")).json()["error"]["code"] == "unauthorized"
    assert run(call(app, "GET", "/v1/models", key=KEY)).status_code == 200
    assert run(call(app, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
    assert run(call(app, "GET", "/v2/health/ready")).status_code == 200  # probes need no key


def test_refusals_beyond_loopback_without_key_and_an_unverifiable_seal(folder, tmp_path, capsys):
    assert cli_main(["serve", str(folder), "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    sealed = tmp_path / "sealed"
    _, pred = tiny_models(0)
    pred.save_pretrained(sealed)
    (sealed / "SHA256SUMS").write_text("0" * 64 + "  model.safetensors\n")
    assert cli_main(["serve", str(sealed), "--tokenizer", str(folder / "tokenizer")]) == 3
    assert "SHA256SUMS" in capsys.readouterr().err


def test_missing_extra_exits_6_with_the_install_line(folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "finetune_csv.serve")
    assert cli_main(["serve", str(folder)]) == 6
    assert "[serve]" in capsys.readouterr().err


@pytest.mark.slow
def test_the_real_server_on_loopback_answers_the_readme_client_and_stops_on_sigterm(folder, tmp_path, monkeypatch):
    """`kronos serve` as a process on a free port: ready, the README's Python client, then SIGTERM while a request
    is in flight: the request is answered and the process exits 0. Every wait is bounded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "finetune.cli", "serve", str(folder), "--port", str(port),
                             "--device", "cpu"], env={**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        monkeypatch.chdir(tmp_path)
        frame(60).to_csv("candles.csv", index=False)
        snippet = readme_block("serve-client").replace("http://127.0.0.1:8000", url)
        exec(compile(snippet, "README serve-client", "exec"), {})  # noqa: S102 - the README's snippet, as written
        with ThreadPoolExecutor(1) as pool:
            flying = pool.submit(httpx.post, f"{url}/v1/forecast", timeout=60,
                                 json={"series": [series(i) for i in range(64)], "horizon": 8, "sample_count": 20})
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            answer = flying.result(timeout=90)
        assert answer.status_code == 200 and {o["status"] for o in answer.json()["outputs"]} == {"ok"}
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)



def calibrated_folder(best, paths: int, decoding: dict | None = None):
    """A tiny predictor folder at `best` with margins fitted on stand-in paths (and their sampling record, if
    given) -> (the predictor, the calibration)."""
    tok, pred = tiny_models(0)
    pred.save_pretrained(best)
    tok.save_pretrained(best / "tokenizer")
    r = np.random.default_rng(1)
    cal = fit_calibration(100 * np.exp(r.normal(0, 0.01, (30, paths, 6))), 100 * np.exp(r.normal(0, 0.03, (30, 6))),
                          np.full(30, 100.0))
    if decoding is not None:
        cal["decoding"] = decoding
    (best / "kronos_predictor.json").write_text(json.dumps({"max_context": 64, "lookback": 48, "calibration": cal}))
    return pred, cal


def test_a_calibrated_run_answers_as_predict_df_and_journals_each_served_series(folder, tmp_path):
    """A run's <base_dir>/basemodel/best_model with a calibration: the served numbers equal predict_df's calibrated
    ones, and each forecast series is one record of <base_dir>/journal/forecasts.jsonl that `kronos track` reads."""
    best = tmp_path / "myrun" / "basemodel" / "best_model"
    pred, cal = calibrated_folder(best, 20)
    app = create_app({"myrun": (str(best), None, "cpu")}, journal=journal_served)
    app.state.load_all()
    body = {"series": [series("A"), series("B", 40, 1)], "horizon": 4, "quantiles": [0.1, 0.9], "seed": 2}
    out = run(call(app, "POST", "/v1/forecast", json=body)).json()["outputs"]
    assert [o["status"] for o in out] == ["ok", "ok"] and out[0]["calibrated"] is True
    ref = KronosPredictor.from_pretrained(best, device="cpu").predict_df(frame(40, 1), prediction_length=4,
                                                                          quantiles=[0.1, 0.9], seed=2)
    np.testing.assert_allclose(out[1]["quantiles"]["0.1"]["close"], ref["close_q10"], rtol=1e-5)
    np.testing.assert_allclose(out[1]["mean"]["open"], ref["open"], rtol=1e-5)
    records = read_journal(tmp_path / "myrun" / "journal" / "forecasts.jsonl")
    assert [(x["series"], x["origin"]) for x in records] == [("A", frame().timestamps.iloc[-1].isoformat()),
                                                             ("B", frame(40, 1).timestamps.iloc[-1].isoformat())]
    fingerprint = run(call(app, "GET", "/v1/models")).json()["models"][0]
    assert records[0]["model"]["predictor_sha256"] == weights_fingerprint(pred) and fingerprint["name"] == "myrun"
    assert np.asarray(records[1]["samples"]).shape == (20, 4) and records[1]["margins"] == cal["margins"]
    np.testing.assert_allclose(np.asarray(records[1]["samples"])[:, 1].mean(), out[1]["mean"]["close"][1], rtol=1e-5)
    assert records[0]["raw_quantiles"] != records[0]["quantiles"]  # the raw draws are kept beside the published ones

    # kronos track stored an adaptive state: A's tracker moved, B's did not; served forecasts follow it per series
    state = adaptive.start_state(cal, ["A", "B"])
    state["trackers"]["A"]["q"] = (np.asarray(state["trackers"]["A"]["q"]) + 0.5).tolist()
    (best / "kronos_predictor.json").write_text(json.dumps({"max_context": 64, "lookback": 48,
                                                            "calibration": {**cal, "adaptive": state}}))
    assert run(call(app, "POST", "/v1/models/myrun/reload")).status_code == 200
    run(call(app, "POST", "/v1/forecast", json=body))
    now = read_journal(tmp_path / "myrun" / "journal" / "forecasts.jsonl")
    assert [x["series"] for x in now] == ["A", "B", "A"]  # B's repeat, split margins again, is the same forecast
    np.testing.assert_allclose(now[2]["margins"], adaptive.tracker_margins(state, "A"))
    assert not np.allclose(now[2]["margins"], cal["margins"])


def test_the_readme_curl_call_forecasts(folder):
    """README "Serve a model": the body of its curl call, as written, gets a forecast."""
    text = (ROOT / "README.md").read_text(encoding="utf-8").split("## Serve a model", 1)[1]
    body = json.loads(re.search(r"curl -s localhost:8000/v1/forecast .*? -d '(.*?)'\n", text, re.S)[1])
    out = run(call(serve(folder), "POST", "/v1/forecast", json=body)).json()["outputs"]
    assert [(o["status"], len(o["timestamps"]), sorted(o["quantiles"])) for o in out] == [("ok", 3, ["0.1", "0.9"])]
    assert out[0]["timestamps"][0] == "2024-01-08T00:00:00"  # the next business day after Friday 2024-01-05


def test_a_default_request_takes_the_sampling_the_calibration_was_fitted_with(folder, tmp_path):
    """A run's calibration records its sampling (32 paths, top_p 1.0 here): a request that names none gets those and
    calibrated bands equal to predict_df's under them; a request with other sampling gets raw bands, said."""
    best = tmp_path / "cal" / "best_model"
    calibrated_folder(best, 32, {"T": 1.0, "top_k": 0, "top_p": 1.0, "sample_count": 32})
    app = create_app({"cal": (str(best), None, "cpu")})
    app.state.load_all()
    body = {"series": [series("A")], "horizon": 4, "quantiles": [0.1, 0.9], "seed": 3}
    out = run(call(app, "POST", "/v1/forecast", json=body)).json()["outputs"][0]
    ref = KronosPredictor.from_pretrained(best, device="cpu").predict_df(
        frame(), prediction_length=4, quantiles=[0.1, 0.9], seed=3, sample_count=32, top_p=1.0)
    assert out["calibrated"] is True
    np.testing.assert_allclose(out["quantiles"]["0.9"]["close"], ref["close_q90"], rtol=1e-5)
    other = run(call(app, "POST", "/v1/forecast", json={**body, "sample_count": 20})).json()["outputs"][0]
    assert other["status"] == "ok" and other["calibrated"] is False


def test_the_calendars_caveats_come_back_with_the_series_they_concern(folder):
    """Daily business-day bars without a holiday calendar: predict_df warns that holidays are forecast as trading
    days; the service says so in that series' output (not only in its log), and a series gets only its own caveats."""
    app = serve(folder)
    daily = series("D")
    daily["timestamps"] = pd.bdate_range("2024-01-01", periods=60).astype(str).tolist()
    out = run(call(app, "POST", "/v1/forecast", json={"series": [daily, series("H")], "horizon": 3}))
    d, h = out.json()["outputs"]
    assert d["status"] == "ok" and any("holiday" in w for w in d["warnings"])
    assert not any("holiday" in w for w in h["warnings"])  # 60 hourly bars: its own caveat (too little history)
    assert any("no whole session" in w for w in h["warnings"])
    with pytest.warns(UserWarning, match="holiday"):  # the same caveat predict_df gives for these bars
        KronosPredictor.from_pretrained(folder, device="cpu").predict_df(
            pd.DataFrame({**{c: daily[c] for c in ("open", "high", "low", "close")},
                          "timestamps": pd.to_datetime(daily["timestamps"])}), prediction_length=3)


def test_identical_requests_at_once_are_each_answered_and_the_batcher_lives_on(folder):
    """Two clients sending the same body at once: two jobs in one pass (the batcher once compared jobs field by
    field, DataFrames included, and its loop died: every later request hung)."""
    app = serve(folder, max_batch_size=2, max_wait_ms=10_000)
    body = {"series": [series(0, 60, 0)], "horizon": 3, "quantiles": [0.5], "seed": 0}

    async def crowd():
        return await asyncio.wait_for(asyncio.gather(*(call(app, "POST", "/v1/forecast", json=body)
                                                       for _ in range(3))), 60)  # a dead batcher: fail, not hang

    answers = run(crowd())
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].json()["outputs"] == answers[1].json()["outputs"] == answers[2].json()["outputs"]
