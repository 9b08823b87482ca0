"""Benchmark the prepared data store: peak memory per rank and time to the first train step under torchrun, on the
first run (rank 0 prepares) and a re-run (the store is reused), plus preparation throughput against the pandas path.

    python scripts/bench_data_store.py --rows 100_000_000 --series 2000 [--nproc 2] [--data-dir /tmp/kronos_store_bench]

1. Generates `--series` Parquet files of rows/series 5-minute bars each under `<data-dir>/parquet` (once; kept for
   re-runs, never in the repository; 100M rows take about 5 GB, the store about 7 GB).
2. Runs `torchrun --nproc_per_node=<nproc>` of this script's worker twice: first with no store (rank 0 prepares
   it while the other ranks wait at the barrier), then again (the store is reused). Each rank opens the store
   memory-mapped, splits it 90/10, builds the epoch sampler, gathers one batch of 512+48 windows and does one
   train step of a small tokenizer under DDP (gloo). It reports the seconds from launch to: store ready, sampler
   ready, first step done; and peak memory sampled every 20 ms from /proc/self/status: RssAnon (private memory:
   what each rank costs beyond the shared page cache) and RssFile (pages of mapped files: the page cache shared
   by all ranks). The epoch order is the sampler's: above 16.8M windows the blocked streaming order
   (finetune/utils/windows.py), so "sampler ready" is immediate.
3. Preparation throughput on `--baseline-rows` rows written as CSV: tests/csv_reference.py load_series (pandas, the
   in-memory reference) against prepare_store on the same CSV files and on the same rows as Parquet; each run in a fresh
   process, with its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

T0_ENV = "BENCH_DATA_STORE_T0"
BAR_NS = 300 * 10**9  # 5 minutes


class PeakMemory:
    """Samples RssAnon / RssFile of this process every `every_s` seconds; keeps the maxima (MiB)."""

    def __init__(self, every_s: float = 0.02):
        self.peak = {"RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, float]:
        now = {}
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("RssAnon", "RssFile", "VmHWM"):
                    now[key] = int(line.split()[1]) / 1024
        for k in self.peak:
            self.peak[k] = max(self.peak[k], now.get(k, 0.0))
        return now

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(every_s)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        last = self.sample()
        return {"peak_anon_mib": self.peak["RssAnon"], "peak_file_mib": self.peak["RssFile"],
                "vm_hwm_mib": last.get("VmHWM", 0.0)}


# ----------------------------------------------------------------------------------------------------------------
# data


def series_frame(i: int, bars: int, start_ns: int):
    """One synthetic 5-minute series as an Arrow table (random walk OHLCV; timestamps typed, naive)."""
    import pyarrow as pa

    rng = np.random.default_rng(i)
    close = 100.0 * np.exp(np.cumsum(rng.normal(0, 0.002, bars)))
    open_ = np.concatenate([[close[0]], close[:-1]])
    spread = np.abs(rng.normal(0, 0.001, bars)) * close
    volume = rng.integers(100, 10_000, bars).astype(np.float64)
    ts = start_ns + np.arange(bars, dtype=np.int64) * BAR_NS
    return pa.table({"timestamps": pa.array(ts.astype("datetime64[ns]")), "open": open_,
                     "high": np.maximum(open_, close) + spread, "low": np.minimum(open_, close) - spread,
                     "close": close, "volume": volume, "amount": volume * close})


def generate_parquet(folder: Path, series: int, bars: int) -> None:
    import pyarrow.parquet as pq

    marker = folder / "_generated.json"
    want = {"series": series, "bars": bars}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.perf_counter()
    start = int(np.datetime64("2020-01-01T00:00", "ns").astype(np.int64))
    for i in range(series):
        pq.write_table(series_frame(i, bars, start), folder / f"S{i:05d}.parquet")
    marker.write_text(json.dumps(want))
    print(f"generated {series} x {bars} bars as Parquet in {time.perf_counter() - t0:.1f} s", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# torchrun worker


def worker(data: str, store: str, lookback: int, predict: int, batch: int) -> None:
    t0 = float(os.environ[T0_ENV])
    mem = PeakMemory()
    import torch

    from finetune.utils.distributed import barrier, distributed_context
    from finetune.utils.windows import EpochSampler, split_panel
    from finetune_csv.data import ensure_store
    from model import KronosTokenizer

    torch.set_num_threads(1)
    out: dict = {}
    with distributed_context(timeout_s=3600) as dist:
        t_import = time.time() - t0
        info = ensure_store(data, store, dist=dist, barrier=barrier)
        panel = info.open()
        t_store = time.time() - t0
        anon_store = mem.sample()["RssAnon"]
        train = split_panel(panel, 0.9, 0.1, 0.0, lookback, predict)["train"].dataset(lookback, predict)
        sampler = EpochSampler(len(train), shuffle=True, seed=0, rank=dist.rank, world_size=dist.world_size)
        sampler.set_epoch(0)
        order = iter(sampler)
        indices = [next(order)]  # the sampler computes the epoch order here
        t_sampler = time.time() - t0
        anon_sampler = mem.sample()["RssAnon"]
        indices += [next(order) for _ in range(batch - 1)]
        x, _stamp = train.get_batch(indices)
        t_batch = time.time() - t0
        torch.manual_seed(0)
        tok = KronosTokenizer(6, 32, 2, 64, 2, 2, 0.0, 0.0, 0.0, 6, 6, 0.05, 1.0, 1.1, 0.05, 4)
        model = torch.nn.parallel.DistributedDataParallel(tok) if dist.distributed else tok
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        (z_pre, z), bsq_loss, _, _ = model(x)
        loss = ((z_pre - x) ** 2).mean() + ((z - x) ** 2).mean() + bsq_loss
        loss.backward()
        opt.step()
        t_step = time.time() - t0
        out = {"rank": dist.rank, "reused": info.reused, "reason": info.reason, "n_rows": panel.n_rows,
               "n_series": panel.n_series, "train_windows": len(train), "t_import_s": t_import,
               "t_store_ready_s": t_store, "t_sampler_s": t_sampler, "t_batch_s": t_batch, "t_first_step_s": t_step,
               "anon_after_store_mib": anon_store, "anon_after_sampler_mib": anon_sampler,
               "prepare_seconds": info.manifest.get("prepare_seconds") if not info.reused else None}
    out.update(mem.stop())
    print("RESULT " + json.dumps(out), flush=True)


def run_torchrun(script: Path, args: argparse.Namespace, data: Path, store: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(script), "--worker", "--data", str(data), "--store", str(store), "--lookback", str(args.lookback),
           "--predict", str(args.predict), "--batch", str(args.batch)]
    env = {**os.environ, T0_ENV: repr(time.time()), "DIST_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    job = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if job.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{job.stdout[-3000:]}\n{job.stderr[-5000:]}")
    results = [json.loads(line[7:]) for line in job.stdout.splitlines() if line.startswith("RESULT ")]
    return sorted(results, key=lambda r: r["rank"])


# ----------------------------------------------------------------------------------------------------------------
# preparation throughput (each in a fresh process, for a clean peak RSS)


def measure_prepare(kind: str, path: str, out: str) -> None:
    import resource

    from finetune_csv.config import DataConfig
    from finetune_csv.data import prepare_store
    from tests.csv_reference import load_series  # the in-memory pandas loader (a reference, not production)

    t0 = time.perf_counter()  # imports are not timed
    if kind == "pandas":
        rows = sum(len(s.values) for s in load_series(DataConfig(path=path)))
    else:
        rows = prepare_store(path, out).manifest["n_rows"]
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"kind": kind, "rows": rows, "seconds": seconds, "peak_rss_mib": rss}), flush=True)


def prepare_throughput(script: Path, root: Path, rows: int, bars: int) -> list[dict]:
    import pyarrow.csv as pa_csv

    series = max(1, rows // bars)
    csv_dir, pq_dir = root / "baseline_csv", root / "baseline_parquet"
    for d in (csv_dir, pq_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    import pyarrow.parquet as pq

    start = int(np.datetime64("2020-01-01T00:00", "ns").astype(np.int64))
    for i in range(series):
        table = series_frame(i, bars, start)
        pq.write_table(table, pq_dir / f"S{i:05d}.parquet")
        # timestamps as 'YYYY-MM-DD HH:MM:SS' text, the usual CSV form
        text = table.set_column(0, "timestamps", table.column(0).cast("timestamp[s]").cast("string"))
        pa_csv.write_csv(text, csv_dir / f"S{i:05d}.csv")
    results = []
    for kind, path in (("pandas", csv_dir), ("store_csv", csv_dir), ("store_parquet", pq_dir)):
        out = root / f"baseline_store_{kind}"
        shutil.rmtree(out, ignore_errors=True)
        job = subprocess.run([sys.executable, str(script), "--measure", kind, "--data", str(path), "--store", str(out)],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
        if job.returncode != 0:
            raise SystemExit(f"{kind} failed:\n{job.stderr[-3000:]}")
        results += [json.loads(line[7:]) for line in job.stdout.splitlines() if line.startswith("RESULT ")]
        shutil.rmtree(out, ignore_errors=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000_000, help="total rows of the synthetic Parquet folder")
    p.add_argument("--series", type=int, default=2000, help="series (one Parquet file each)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--data-dir", default="/tmp/kronos_store_bench")
    p.add_argument("--lookback", type=int, default=512)
    p.add_argument("--predict", type=int, default=48)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--baseline-rows", type=int, default=1_000_000, help="rows for the throughput comparison; 0 skips")
    p.add_argument("--keep", action="store_true", help="keep the generated data and the store")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.data, args.store, args.lookback, args.predict, args.batch)
    if args.measure:
        return measure_prepare(args.measure, args.data, args.store)

    script = Path(__file__).resolve()
    root = Path(args.data_dir)
    bars = args.rows // args.series
    data, store = root / "parquet", root / "store"
    generate_parquet(data, args.series, bars)
    shutil.rmtree(store, ignore_errors=True)
    runs = {"first run (prepare)": run_torchrun(script, args, data, store),
            "re-run (reuse)": run_torchrun(script, args, data, store)}
    size = sum(f.stat().st_size for f in store.iterdir()) / 2**30
    print(f"\ndata: {args.series} series x {bars:,} 5-min bars = {args.series * bars:,} rows (Parquet "
          f"{sum(f.stat().st_size for f in data.iterdir()) / 2**30:.2f} GiB, store {size:.2f} GiB), "
          f"torchrun --nproc_per_node={args.nproc}, windows {args.lookback}+{args.predict}, batch {args.batch}")
    print("seconds since launch: imports done / store ready / sampler ready / first batch read / first step done")
    print("| run | rank | imports | store | sampler | batch | first step | peak private (RssAnon) MiB | "
          "private after sampler MiB | peak mapped (RssFile) MiB | prepare s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, results in runs.items():
        for r in results:
            prep = f"{r['prepare_seconds']:.1f}" if r["prepare_seconds"] else ""
            print(f"| {name} | {r['rank']} | {r['t_import_s']:.1f} | {r['t_store_ready_s']:.1f} | "
                  f"{r['t_sampler_s']:.1f} | {r['t_batch_s']:.1f} | "
                  f"{r['t_first_step_s']:.1f} | {r['peak_anon_mib']:.0f} | {r['anon_after_sampler_mib']:.0f} | "
                  f"{r['peak_file_mib']:.0f} | {prep} |")
    if args.baseline_rows:
        results = prepare_throughput(script, root, args.baseline_rows, bars)
        base = next(r for r in results if r["kind"] == "pandas")
        print(f"\npreparation of {base['rows']:,} rows ({max(1, args.baseline_rows // bars)} files):")
        print("| path | seconds | rows/s | speed-up | peak RSS MiB |")
        print("|---|---|---|---|---|")
        for r in results:
            rate = r["rows"] / r["seconds"]
            print(f"| {r['kind']} | {r['seconds']:.2f} | {rate:,.0f} | {rate / (base['rows'] / base['seconds']):.1f}x"
                  f" | {r['peak_rss_mib']:.0f} |")
    if not args.keep:  # 100M rows: ~6 GB of Parquet and ~7 GB of store
        shutil.rmtree(root, ignore_errors=True)  # Parquet, store and the throughput baseline files


if __name__ == "__main__":
    main()
