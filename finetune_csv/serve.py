"""`kronos serve MODEL [MODEL ...]`: finetuned Kronos models as a forecast service (FastAPI + uvicorn, the `serve`
extra): health probes, the models, forecasts micro-batched across requests, Prometheus metrics, hot reload and a page
to use it from a browser (serve_page.html). Usage, endpoints and the scale-out path: README "Serve a model"."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import logging
import os
import secrets
import signal
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from finetune.utils.errors import run_main, setup_logging
from finetune_csv.journal import append_forecasts, journal_records
from model import adaptive
from model.calibration import calibration_shift, decoding_changes
from model.errors import DataError, UserError
from model.features import CLOSE, FEATURES, PRICE_FEATURES
from model.fileio import sha256_file
from model.frames import read_frame
from model.hub import weights_fingerprint
from model.predictor import MIN_QUANTILE_SAMPLES, KronosPredictor

log = logging.getLogger(__name__)
PAGE = Path(__file__).with_name("serve_page.html")
OPEN = {"/", "/v2/health/live", "/v2/health/ready", "/docs", "/openapi.json"}  # answered without the API key
# A journal hook: (the model, the request's settings, its job) after each served forecast (`journal_served`).
Journal = Callable[["Served", dict[str, Any], "Job"], None]


class SeriesIn(BaseModel):
    """One series, column-wise: stamps (ISO text or epoch numbers) and its candles; null = a missing value."""

    model_config = ConfigDict(extra="forbid")
    id: str | int
    timestamps: list[str | float]
    open: list[float | None]
    high: list[float | None]
    low: list[float | None]
    close: list[float | None]
    volume: list[float | None] | None = None
    amount: list[float | None] | None = None


class ForecastIn(BaseModel):
    """POST /v1/forecast's body. sample_count, T and top_p left out take the sampling the model's calibration was
    fitted with (so a default request gets calibrated bands), else `predict_df`'s defaults."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    series: list[SeriesIn] = Field(min_length=1)
    horizon: int = Field(ge=1)
    quantiles: list[float] = []
    sample_count: int | None = Field(None, ge=1, le=1000)
    T: float | None = Field(None, gt=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = 0  # None: a fresh random seed per request
    holidays: str | None = None
    return_samples: bool = False


@dataclass(eq=False)  # hashed by identity: part of the batching key, so a reloaded model never shares a batch
class Served:
    """One loaded, warmed-up model."""

    name: str
    source: str
    predictor: KronosPredictor
    sha256: str
    tokenizer: str  # what --tokenizer named, else the one the folder records
    fingerprint: str  # weights_fingerprint of the predictor: what `kronos track` matches journaled forecasts by

    def describe(self) -> dict[str, Any]:
        p, cal = self.predictor, self.predictor.calibration
        return {"name": self.name, "sha256": self.sha256, "source": self.source, "max_context": p.max_context,
                "lookback": p.lookback, "device": str(p.device), "tokenizer": self.tokenizer,
                "calibration": cal and {"method": cal["method"], "levels": cal["levels"], "windows": cal["windows"]}}


def model_name(source: str) -> str:
    """A run's best_model/ is called by its run folder, anything else by its own name (a Hub id by its last part)."""
    path = Path(source.rstrip("/"))
    run = run_dir(path)
    return run.name if run else path.parent.name if path.name == "best_model" and path.parent.name else path.name


def load_model(name: str, source: str, tokenizer: str | None, device: str | None) -> Served:
    """`from_pretrained` (a folder whose seal does not verify is refused there), then one forecast to warm it up."""
    predictor = KronosPredictor.from_pretrained(source, tokenizer=tokenizer, device=device)
    weights = Path(source) / "model.safetensors"
    sha = sha256_file(weights) if weights.is_file() else weights_fingerprint(predictor.model)  # the seal's
    n = min(predictor.lookback, predictor.max_context)
    close = 100 * np.exp(np.cumsum(np.random.default_rng(0).normal(0, 0.01, n)))  # a random walk, hourly
    frame = pd.DataFrame({"open": close, "high": close * 1.01, "low": close * 0.99, "close": close})
    stamps = pd.date_range("2024-01-01", periods=n + 1, freq="h")
    predictor.predict_batch([frame], [stamps[:-1]], [stamps[-1:]], 1, verbose=False, calibrated=False,
                            seeds=[0])  # raw: a calibrated folder refuses sampling other than its margins
    return Served(name, source, predictor, sha, tokenizer or "the one the folder records",
                  weights_fingerprint(predictor.model))


@dataclass(eq=False)  # a job is itself: identical requests are two jobs (field equality would compare DataFrames)
class Job:
    """One forecast request on its way through the batcher: the outputs are filled in, in the series' order."""

    body: ForecastIn
    model: Served
    seed: int
    ready: list[tuple] = field(default_factory=list)  # its series as `check_series` returns them
    outputs: list[dict[str, Any] | None] = field(default_factory=list)
    paths: dict[int, tuple] = field(default_factory=dict)  # series position -> (origin, last close, raw, published
    # closes (S, P), the margins applied or None): what the journal keeps


def check_series(p: KronosPredictor, body: ForecastIn) -> list[tuple]:
    """A request's series -> (id, its candles indexed by time, its stamps, the forecast stamps of its calendar, the
    calendar's warnings) each, by `predict_df`'s rules (`read_frame`), checked as `predict_batch` checks a series
    (its `prepare`) before the request joins a batch: a bad series refuses its own request (a DataError naming it)
    instead of failing the merged pass of every request batched with it."""
    out = []
    for s in body.series:
        cols = {c: getattr(s, c) for c in ("timestamps", *FEATURES) if getattr(s, c, None) is not None}
        try:
            if len(set((lengths := {c: len(v) for c, v in cols.items()}).values())) > 1:
                raise DataError(f"its columns have different lengths {lengths}")
            frame = pd.DataFrame({c: np.asarray(v, dtype=object if c == "timestamps" else float)
                                  for c, v in cols.items()})
            with warnings.catch_warnings(record=True) as said:  # the calendar's caveats go back to the caller
                warnings.simplefilter("always")
                fs = read_frame(frame, body.horizon, holidays=body.holidays)
            _, rows, future = fs.series[0]
            candles, stamps = fs.frame(rows), fs.stamps[rows]
            p.prepare(candles, stamps, future, body.horizon, f"series {s.id!r}")
        except (UserError, ValueError) as exc:
            msg, name = str(exc).splitlines()[0], f"series {s.id!r}"
            raise DataError(msg if name in msg else f"{name}: {msg}") from None
        out.append((s.id, candles, stamps, future, [str(w.message) for w in said]))
    return out


def _output(sid: Any, index: pd.Index, paths: np.ndarray, mean: np.ndarray, calibrated: bool, quantiles: list[float],
            samples: bool) -> dict[str, Any]:
    """One series' answer from its (S, P, 6) published paths and (P, 6) mean, as `predict_batch` makes them."""
    table = lambda a: {c: a[:, i].astype(float).tolist() for i, c in enumerate(FEATURES)}  # noqa: E731 (P, 6)
    out = {"id": sid, "status": "ok", "timestamps": [t.isoformat() for t in index], "mean": table(mean),
           "quantiles": {str(q): table(np.quantile(paths, q, axis=0)) for q in quantiles}, "calibrated": calibrated}
    if samples:  # (S, P, 6) -> {feature: S x P}
        out["samples"] = {c: paths[..., i].astype(float).tolist() for i, c in enumerate(FEATURES)}
    return out


def forecast_jobs(model: Served, jobs: list[Job]) -> None:
    """Forecast the checked series (`check_series`) of every job in one batched pass (they share horizon and decoding
    settings); each series draws from its own generator seeded by its request's seed, so its numbers never depend on
    its batch. Should that pass still fail, each series is forecast alone (logged), so a failure lands on its own
    series only (status "error" with the one-line message). The predictor's calibration is
    applied here, as `predict_batch` applies it, so the raw draws stay for the journal; where it does not hold (other
    decoding, a longer horizon) the answer is raw and says `"calibrated": false`."""
    p, body = model.predictor, jobs[0].body
    cal = p.calibration
    if cal is not None and (decoding_changes(cal, {"T": body.T, "top_k": 0, "top_p": body.top_p, "sample_count":
                                                   body.sample_count}) or body.horizon > len(cal["margins"][0])):
        cal = None
    todo = [(job, i, *ready) for job in jobs for i, ready in enumerate(job.ready)]  # (job, position, series id,
    # candles, stamps, forecast stamps, warnings)
    for job in jobs:
        job.outputs, job.paths = [None] * len(job.body.series), {}

    def run(items: list) -> list:
        return p.predict_batch([t[3] for t in items], [t[4] for t in items], [t[5] for t in items], body.horizon,
                               body.T, 0, body.top_p, body.sample_count, False, True, None, False,
                               series_names=[f"series {t[2]!r}" for t in items], seeds=[t[0].seed for t in items])

    try:
        results = run(todo)
    except Exception:  # noqa: BLE001 - unexpected (the series were checked): each alone (same numbers), N passes
        log.exception("a merged pass of %d series failed; forecasting each alone", len(todo))
        results = []
        for t in todo:
            try:
                results.append(run([t])[0])
            except UserError as exc:
                results.append(str(exc).splitlines()[0])
    for (job, i, sid, candles, stamps, _, said), res in zip(todo, results):
        if isinstance(res, str):
            job.outputs[i] = {"id": sid, "status": "error", "error": res}
            continue
        raw, last = res.samples, float(candles["close"].iloc[-1])  # (S, P, 6) as drawn
        paths, used = raw.copy(), adaptive.current_calibration(cal, str(sid))  # an adaptive state's margins, as
        if used is not None:  # `kronos forecast --future` applies them, else the split ones
            paths[..., :len(PRICE_FEATURES)] *= np.exp(calibration_shift(used, raw[..., CLOSE], np.float64(last)))[
                ..., None]
        job.paths[i] = (stamps[-1], last, raw[..., CLOSE], paths[..., CLOSE], used and used["margins"])
        job.outputs[i] = _output(sid, res.mean.index, paths, paths.mean(0) if cal else res.mean.to_numpy(),
                                 cal is not None, job.body.quantiles, job.body.return_samples)
        if said:
            job.outputs[i]["warnings"] = said


def run_dir(source: str | Path) -> Path | None:
    """The run folder (paths.base_dir) of a run's <base_dir>/basemodel/best_model, else None."""
    path = Path(source)
    return path.parent.parent if path.name == "best_model" and path.parent.name == "basemodel" else None


def journal_served(model: Served, settings: dict[str, Any], job: Job) -> None:
    """Append the forecast `job` got from a run's best_model to the run's journal (`kronos track` scores it): one
    record per series that forecast, as `kronos forecast --future` writes them."""
    base, ok = run_dir(model.source), sorted(job.paths)
    if base is None or not ok:
        return
    origins, last, raw, paths, margins = zip(*(job.paths[i] for i in ok))
    append_forecasts(base, journal_records(
        {"folder": model.source, "predictor_sha256": model.fingerprint, "served_sha256": model.sha256},
        {**settings, "command": "serve"}, [str(job.body.series[i].id) for i in ok], list(origins), np.array(last),
        np.stack(raw), np.stack(paths), None if margins[0] is None else list(margins)))


class Batcher:
    """Merges concurrent requests with the same key (model, horizon, decoding settings) into one forward pass of at
    most `max_series` series, waiting at most `max_wait` s for company; the pass runs off the event loop, one at a
    time (`pool`: a single thread; torch's own threads work inside it)."""

    def __init__(self, max_series: int, max_wait: float, batch_sizes: Histogram, depth: Gauge):
        self.max_series, self.max_wait, self.batch_sizes, self.depth = max_series, max_wait, batch_sizes, depth
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="forecast")
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None

    async def submit(self, key: tuple, job: Job) -> Job:
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.get_loop() is not loop or self.task.done():  # started inside the loop
            self.queue, self.task = asyncio.Queue(), loop.create_task(self._loop())  # that serves: a closed one's
            # queue never drains
        done = loop.create_future()
        self.depth.inc()
        self.queue.put_nowait((key, job, done))
        return await done

    async def _gather(self, waiting: list) -> None:
        """Wait for requests of waiting[0]'s key until max_series series or max_wait s (those queued come at once)."""
        loop, key = asyncio.get_running_loop(), waiting[0][0]
        deadline = loop.time() + self.max_wait
        while sum(len(j.body.series) for k, j, _ in waiting if k == key) < self.max_series:
            try:
                waiting.append(self.queue.get_nowait())
            except asyncio.QueueEmpty:
                if (left := deadline - loop.time()) <= 0:
                    return
                try:
                    waiting.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:  # noqa: UP041 - not the builtin TimeoutError on Python 3.10
                    return

    async def _loop(self) -> None:
        waiting: list = []  # (key, job, future), oldest first; other keys wait for a later pass
        while True:
            if not waiting:
                waiting.append(await self.queue.get())
            await self._gather(waiting)
            key, take, size = waiting[0][0], [], 0
            for item in waiting:
                if item[0] == key and (not take or size + len(item[1].body.series) <= self.max_series):
                    take.append(item)
                    size += len(item[1].body.series)
            waiting = [item for item in waiting if item not in take]
            self.depth.dec(len(take))
            self.batch_sizes.observe(size)
            try:
                await asyncio.get_running_loop().run_in_executor(self.pool, forecast_jobs, key[0], [j for _, j, _ in
                                                                                                     take])
                outcome: dict = {}
            except Exception as exc:  # noqa: BLE001 - a bug reaches its requests as a 500, and the loop lives on
                log.exception("forecast failed")
                outcome = {"error": exc}
            for _, job, done in take:
                if not done.done():  # the client may have gone
                    done.set_exception(outcome["error"]) if outcome else done.set_result(job)


def envelope(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def create_app(models: dict[str, tuple[str, str | None, str | None]], *, api_key: str | None = None,
               max_batch_size: int = 64, max_wait_ms: float = 10.0, max_series: int = 1000,
               max_horizon: int | None = None, max_body_bytes: int = 32 << 20, journal: Journal | None = None,
               ) -> FastAPI:
    """The service over `models` {name: (folder or Hub id, tokenizer or None, device or None)}; `load_all()` (or the
    server's start) loads and warms them up, and ready turns true. journal: called with (model folder, the
    request's settings, its job) after each forecast (errors there are logged, the forecast still answered)."""
    app = FastAPI(title="Kronos forecast service")
    reg = CollectorRegistry()
    requests = Counter("kronos_requests", "HTTP requests by route and status", ["route", "status"], registry=reg)
    latency = Histogram("kronos_request_seconds", "request latency by route", ["route"], registry=reg)
    series = Counter("kronos_series", "series forecast, by status", ["status"], registry=reg)
    batch_sizes = Histogram("kronos_batch_size", "series per forward pass", registry=reg,
                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
    batcher = Batcher(max_batch_size, max_wait_ms / 1000, batch_sizes,
                      Gauge("kronos_queue_depth", "requests waiting for a forward pass", registry=reg))
    served: dict[str, Served] = {}

    def load(name: str) -> Served:
        served[name] = load_model(name, *models[name])  # swapped in only once warmed up
        return served[name]

    app.state.load_all = lambda: [load(name) for name in models]

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable) -> Response:
        route, start = request.url.path, asyncio.get_running_loop().time()
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if api_key and route not in OPEN and not hmac.compare_digest(given.encode(), api_key.encode()):
            response = envelope(401, "unauthorized", "a valid API key is needed: 'Authorization: Bearer KEY' or "
                                                     "'X-API-Key: KEY'")
        else:
            response = await call_next(request)
            route = getattr(request.scope.get("route"), "path", "unmatched")
        requests.labels(route, str(response.status_code)).inc()
        latency.labels(route).observe(asyncio.get_running_loop().time() - start)
        return response

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return envelope(exc.status_code, "not_found" if exc.status_code == 404 else "http_error", str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return envelope(422, "invalid_request", "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                          for e in exc.errors()))

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:
        log.error("request failed: %r", exc)
        return envelope(500, "internal", f"{type(exc).__name__}: {exc}")

    @app.get("/v2/health/live")
    async def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        ok = len(served) == len(models)
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"models": [m.describe() for m in served.values()]}

    @app.post("/v1/models/{name}/reload")
    async def reload(name: str) -> Response:
        if name not in models:
            return envelope(404, "not_found", f"no model {name!r}; the models are {sorted(models)}")
        try:  # in-flight requests hold the old model and finish on it
            model = await asyncio.get_running_loop().run_in_executor(None, load, name)
        except UserError as exc:
            return envelope(409, "reload_failed", f"{exc}; the model loaded before keeps serving")
        return JSONResponse(model.describe())

    @app.post("/v1/forecast")
    async def forecast(request: Request) -> Response:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                return envelope(413, "too_large", f"the body is over {max_body_bytes} bytes (--max-body-mb); send "
                                                  "fewer series per request")
        try:
            req = ForecastIn.model_validate_json(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        name = req.model or next(iter(models))
        if name not in served:
            return envelope(404 if name not in models else 503, "not_found" if name not in models else "not_ready",
                            f"model {name!r} is not served (the models are {sorted(models)})" if name not in models
                            else f"model {name!r} is still loading")
        model = served[name]
        fitted = (model.predictor.calibration or {}).get("decoding") or {}
        req = req.model_copy(update={k: fitted.get(k, default) for k, default in (
            ("sample_count", MIN_QUANTILE_SAMPLES), ("T", 1.0), ("top_p", 0.9)) if getattr(req, k) is None})
        cap = min(model.predictor.max_context, max_horizon or model.predictor.max_context)
        problem = (f"horizon {req.horizon} is over {cap} (the model's window, or --max-horizon)" if req.horizon > cap
                   else f"{len(req.series)} series are over {max_series} per request (--max-series)"
                   if len(req.series) > max_series else None)
        if problem:
            return envelope(422, "limit", problem)
        job = Job(req, model, secrets.randbits(63) if req.seed is None else req.seed)
        try:  # on the forecast thread: catch_warnings is process-wide, and each series gets only its own caveats
            job.ready = await asyncio.get_running_loop().run_in_executor(batcher.pool, check_series, model.predictor,
                                                                         req)
        except DataError as exc:
            series.labels("error").inc()
            return envelope(422, "invalid_series", str(exc))
        await batcher.submit((model, req.horizon, req.sample_count, req.T, req.top_p), job)
        for out in job.outputs:
            series.labels(out["status"]).inc()
        if journal is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(  # an fsync: off the event loop
                    None, journal, model, req.model_dump(exclude={"series"}), job)
            except Exception:  # noqa: BLE001 - the forecast is answered; the journal's failure is logged
                log.exception("the forecast journal failed")
        return JSONResponse({"model": name, "sha256": model.sha256, "outputs": job.outputs})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        if not hasattr(app.state, "page"):
            from plotly.offline import get_plotlyjs  # inlined as report.html does: no request beyond the server

            app.state.page = PAGE.read_text(encoding="utf-8").replace("/*PLOTLY_JS*/", get_plotlyjs(), 1)
        return HTMLResponse(app.state.page)

    return app


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kronos serve", description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", metavar="MODEL", help="a run's best_model/ (or any folder or Hub id "
                        "from_pretrained takes)")
    parser.add_argument("--tokenizer", help="the tokenizer of a published pair, e.g. NeoQuasar/Kronos-Tokenizer-base")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("KRONOS_API_KEY"),
                        help="required in 'Authorization: Bearer KEY' or 'X-API-Key: KEY' (default $KRONOS_API_KEY)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="series per forward pass")
    parser.add_argument("--max-wait-ms", type=float, default=10.0, help="how long a request waits for company")
    parser.add_argument("--max-series", type=int, default=1000, help="series per request")
    parser.add_argument("--max-horizon", type=int, help="forecast steps per request (default: the model's window)")
    parser.add_argument("--max-body-mb", type=float, default=32.0)
    parser.add_argument("--device", help="cpu, cuda:0, ... (default: the first GPU, else cpu)")
    args = parser.parse_args(argv)
    if not is_loopback(args.host) and not args.api_key:
        parser.error(f"--host {args.host} is reachable beyond this machine: set --api-key KEY (or KRONOS_API_KEY), "
                     "or keep the default --host 127.0.0.1")
    names = [model_name(m) for m in args.models]
    if len(set(names)) < len(names):
        parser.error(f"two models share a name {names}; serve folders of different names")
    setup_logging()
    app = create_app({n: (m, args.tokenizer, args.device) for n, m in zip(names, args.models)},
                     api_key=args.api_key, max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                     max_series=args.max_series, max_horizon=args.max_horizon,
                     max_body_bytes=int(args.max_body_mb * 2**20), journal=journal_served)
    app.state.load_all()  # a folder that cannot load is refused here, before the port opens
    log.info("serving %s on http://%s:%d", ", ".join(names), args.host, args.port)
    # uvicorn stops accepting on SIGTERM, finishes the requests in flight, then raises the signal again under the
    # handler it found: a stop that was asked for exits 0, not -15.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
