"""Load benchmark of `kronos serve`: locust, headless, in this process, against a real `kronos serve` on 127.0.0.1
(nothing else is reached), every cell bounded by --seconds. Per model (Kronos-small + Tokenizer-base shapes with
random weights, and the demo checkpoint) and request size (1 series, or 100 series per request; context 512 -> 24):
p50 / p95 latency, requests per second and errors at 1, 8 and 32 concurrent clients (each sends its next request
when the last is answered), and the sizes of the forward passes the server's batcher ran (kronos_batch_size).
The 1-client cell is the same requests sent one after another. Results: docs/benchmarks.md, "kronos serve".

    .venv/bin/python scripts/bench_serve.py --seconds 30          (pip install locust first)
"""

import argparse  # noqa: E402, I001
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import gevent
import httpx
import numpy as np
import pandas as pd
from locust import HttpUser, constant, task  # first: locust patches the standard library with gevent
from locust.env import Environment
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "checkpoints" / "demo-pretrained"


def small_folder(root: Path) -> Path:
    """Kronos-small + Kronos-Tokenizer-base shapes, random weights (speed does not depend on them), window 512."""
    from model import Kronos, KronosTokenizer
    from model.config import KronosConfig, KronosTokenizerConfig

    folder = root / "kronos-small-shapes"
    Kronos(**asdict(KronosConfig(s1_bits=10, s2_bits=10))).save_pretrained(folder)
    KronosTokenizer(**asdict(KronosTokenizerConfig())).save_pretrained(folder / "tokenizer")
    (folder / "kronos_predictor.json").write_text('{"max_context": 512, "lookback": 512}')
    return folder


def body(n_series: int, context: int, horizon: int, samples: int) -> dict:
    """n_series hourly random walks of `context` bars each (weekdays only, so every calendar is learnt)."""
    stamps = pd.bdate_range("2024-01-01", periods=context // 8 + 1).repeat(8)[:context] + pd.to_timedelta(
        np.tile(np.arange(9, 17), context // 8 + 1)[:context], unit="h")
    out = []
    for i in range(n_series):
        c = 100 * np.exp(np.cumsum(np.random.default_rng(i).normal(0, 0.01, context)))
        out.append({"id": f"S{i}", "timestamps": stamps.astype(str).tolist(), "open": c.tolist(),
                    "high": (c * 1.01).tolist(), "low": (c * 0.99).tolist(), "close": c.tolist()})
    return {"series": out, "horizon": horizon, "sample_count": samples, "seed": 0}


def batch_sizes(url: str) -> dict[float, float]:
    """kronos_batch_size's cumulative bucket counts {upper bound: passes}."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "kronos_batch_size")
    return {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}


class Client(HttpUser):
    wait_time = constant(0)
    payload: dict = {}

    @task
    def forecast(self) -> None:
        with self.client.post("/v1/forecast", json=self.payload, catch_response=True, timeout=300) as r:
            if r.status_code != 200 or any(o["status"] != "ok" for o in r.json()["outputs"]):
                r.failure(f"{r.status_code}: {r.text[:200]}")


def cell(url: str, payload: dict, users: int, seconds: float) -> dict:
    before = batch_sizes(url)
    Client.host, Client.payload = url, payload
    env = Environment(user_classes=[Client])
    runner = env.create_local_runner()
    start = time.perf_counter()
    runner.start(users, spawn_rate=users)
    gevent.sleep(seconds)
    runner.stop()  # requests still in flight are dropped from the figures
    elapsed, total = time.perf_counter() - start, env.stats.total
    httpx.post(f"{url}/v1/forecast", json=payload, timeout=600)  # waits for the server to drain the dropped ones
    after = batch_sizes(url)
    bounds = sorted(after)
    passes = {b: after[b] - before.get(b, 0) for b in bounds}
    hist = {int(b) if b != float("inf") else "inf": passes[b] - (passes[bounds[i - 1]] if i else 0)
            for i, b in enumerate(bounds)}
    return {"users": users, "requests": total.num_requests, "errors": total.num_failures,
            "p50_s": total.get_response_time_percentile(0.5) / 1000,
            "p95_s": total.get_response_time_percentile(0.95) / 1000, "rps": total.num_requests / elapsed,
            "batch_sizes": {k: int(v) for k, v in hist.items() if v}}


def serve(folder: Path, tokenizer: Path | None, args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "finetune.cli", "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--max-batch-size", str(args.max_batch_size), "--max-wait-ms", str(args.max_wait_ms)]
    proc = subprocess.Popen(cmd + (["--tokenizer", str(tokenizer)] if tokenizer else []), cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"kronos serve {folder} did not get ready in 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30, help="length of each cell (at most 60)")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--models", nargs="+", default=["small", "demo"], choices=["small", "demo"])
    parser.add_argument("--series", type=int, nargs="+", default=[1, 100], help="series per request")
    parser.add_argument("--samples", type=int, default=20, help="sample paths per series (predict_df's default)")
    parser.add_argument("--context", type=int, default=512, help="bars per series (the model's lookback: 512)")
    parser.add_argument("--horizon", type=int, default=24)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    args = parser.parse_args()
    print(f"kronos serve under locust: {os.cpu_count()} CPU cores, {args.seconds:g} s per cell, context "
          f"{args.context} -> {args.horizon}, {args.samples} sample paths, --max-batch-size {args.max_batch_size} "
          f"--max-wait-ms {args.max_wait_ms:g}")
    print("| model | series / request | clients | requests | errors | p50 s | p95 s | req/s | series/s | "
          "forward passes by size |\n|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            folder, tok = (small_folder(Path(tmp)), None) if name == "small" else (DEMO / "predictor",
                                                                                   DEMO / "tokenizer")
            proc, url = serve(folder, tok, args)
            try:
                for n in args.series:
                    payload = body(n, args.context, args.horizon, args.samples)
                    for users in args.users:
                        r = cell(url, payload, users, args.seconds)
                        print(f"| {name} | {n} | {users} | {r['requests']} | {r['errors']} | {r['p50_s']:.2f} | "
                              f"{r['p95_s']:.2f} | {r['rps']:.2f} | {r['rps'] * n:.1f} | {r['batch_sizes']} |",
                              flush=True)
            finally:
                proc.terminate()
                proc.wait(120)


if __name__ == "__main__":
    main()
