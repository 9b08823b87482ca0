"""Benchmark the data paths, each against the per-sample pandas approach it replaces, in the same run.

    python -m finetune.benchmarks.data csv   [--series 8 --bars 20000 --lookback 512 --predict 48 --batch 32]
    python -m finetune.benchmarks.data qlib  [--symbols 300 --days 3600 --batch 50 --seconds 3]
    python -m finetune.benchmarks.data store --rows 100_000_000 --series 2000 [--nproc 2]
                                             [--data-dir /tmp/kronos_store_bench]

csv    the CSV pipeline's memory-mapped store + WindowDataset through the engine's DataLoader against
       `df.iloc[start:start + window]` per sample (the original Kronos CSV dataset), and the share of a small
       predictor's train step spent waiting for data; synthetic 5-minute data (finetune.synthetic).
qlib   Qlib-layout daily data: preprocessing (one sort + offsets vs the original's pandas pivot per symbol, timed on
       --baseline-symbols and scaled) and training samples/s (pandas per sample, ours per sample, ours batched).
store  data larger than memory: --series Parquet files under <data-dir>/parquet (kept for re-runs, never in the
       repository), then `torchrun --nproc_per_node=<nproc>` of this module's worker twice (rank 0 prepares the store,
       then it is reused): seconds from launch to each stage and peak memory per rank (RssAnon: private; RssFile:
       mapped pages, shared); then the preparation throughput on --baseline-rows rows (pandas in memory vs
       prepare_store on CSV and on Parquet, each in a fresh process; the pandas side is tests/csv_reference.py, so
       a source checkout only: --baseline-rows 0 skips it).
The numbers depend on the machine: run on an idle one. Results and what made them fast: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd

from model.features import FEATURES, TIME_FEATURES, calc_time_stamps

T0_ENV = "BENCH_DATA_STORE_T0"
BAR_NS = 300 * 10**9  # 5 minutes
START_NS = int(np.datetime64("2020-01-01T00:00", "ns").astype(np.int64))  # first bar of the store benchmark's series
QLIB_LOOKBACK, QLIB_PREDICT = 90, 10


class PandasIlocWindows:
    """The baseline of both pipelines: one pandas DataFrame per series (FEATURES + TIME_FEATURES columns), an `.iloc`
    slice and numpy normalisation by the lookback's statistics per sample."""

    def __init__(self, frames: list[pd.DataFrame], lookback: int, predict: int, clip: float = 5.0):
        self.frames, self.lookback, self.window, self.clip = frames, lookback, lookback + predict, clip
        counts = [max(0, len(f) - self.window + 1) for f in frames]
        self.index = [(i, s) for i, n in enumerate(counts) for s in range(n)]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int):
        import torch

        series, start = self.index[idx]
        window = self.frames[series].iloc[start: start + self.window]
        x = window[list(FEATURES)].to_numpy(dtype=np.float32)
        stamp = window[list(TIME_FEATURES)].to_numpy(dtype=np.int64)
        mean, std = x[: self.lookback].mean(0), x[: self.lookback].std(0)
        x = np.clip((x - mean) / (std + 1e-5), -self.clip, self.clip)
        return torch.from_numpy(x), torch.from_numpy(stamp)


def rate(fn, seconds: float, per_call: int = 1) -> float:
    """Calls of `fn` per second over about `seconds` (after one warm-up call), times `per_call`."""
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return n * per_call / (time.perf_counter() - start)


def csv_bench(args: argparse.Namespace) -> None:
    """The CSV store + WindowDataset against pandas .iloc per sample, and the data-wait share of a train step."""
    import torch
    from torch.utils.data import DataLoader

    from finetune.synthetic import generate_ohlcv, write_csv_folder
    from finetune.utils.windows import EpochSampler, make_loader
    from finetune_csv.config import DataConfig
    from finetune_csv.prepare import prepare_data
    from finetune_csv.splits import build_dataset

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        write_csv_folder(generate_ohlcv(args.series, args.bars, freq="5min", seed=0), Path(tmp) / "csv")
        cfg = DataConfig(path=str(Path(tmp) / "csv"), lookback=args.lookback, predict=args.predict, train_ratio=0.9,
                         val_ratio=0.1, test_ratio=0.0)
        t0 = time.perf_counter()
        data = prepare_data(cfg, Path(tmp) / "store")
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        train = data.splits["train"]
        ours = build_dataset(train, cfg)
        build_s = time.perf_counter() - t0
        frames = []  # the same train rows, copied from the store into one DataFrame per series
        for lo, hi in zip(train.start.tolist(), train.stop.tolist()):
            f = pd.DataFrame(np.asarray(data.panel.features[:, lo:hi]).T, columns=list(FEATURES))  # (n, 6)
            f[list(TIME_FEATURES)] = np.asarray(data.panel.stamps[lo:hi])
            frames.append(f)
        baseline = PandasIlocWindows(frames, args.lookback, args.predict, cfg.clip)
        assert len(baseline) == len(ours), (len(baseline), len(ours))

        def base_loader(seed: int) -> DataLoader:
            return DataLoader(baseline, batch_size=args.batch, shuffle=True,
                              generator=torch.Generator().manual_seed(seed))

        # Timed while the store is still mapped.
        sampler = EpochSampler(len(ours), shuffle=True, seed=0)
        ours_sps = samples_per_second(make_loader(ours, sampler, args.batch, epoch=0, seed=0), args.batches)
        base_sps = samples_per_second(base_loader(0), max(5, args.batches // 6))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        ours_wait, ours_step = data_wait_share(make_loader(ours, sampler, args.batch, epoch=1, seed=0), args.steps,
                                               device)
        base_wait, base_step = data_wait_share(base_loader(1), args.steps, device)
    print(f"data: {args.series} series x {args.bars} bars (5min), {len(ours)} training windows of "
          f"{args.lookback}+{args.predict}; prepare the store (parse+check CSVs) {load_s:.2f} s, "
          f"split + dataset {build_s:.2f} s")
    print(f"device for the train step: {device}, torch threads {torch.get_num_threads()}, batch {args.batch}")
    print(f"{'loader':<34}{'samples/s':>12}{'speed-up':>10}{'data wait':>12}{'step ms':>10}")
    print(f"{'pandas .iloc per sample (baseline)':<34}{base_sps:>12,.0f}{1.0:>9.1f}x{100 * base_wait:>11.1f}%"
          f"{1000 * base_step:>10.1f}")
    print(f"{'store + WindowDataset (batches)':<34}{ours_sps:>12,.0f}{ours_sps / base_sps:>9.1f}x"
          f"{100 * ours_wait:>11.1f}%{1000 * ours_step:>10.1f}")


def samples_per_second(loader, max_batches: int) -> float:
    n, t0 = 0, time.perf_counter()
    for i, (x, _) in enumerate(loader):
        n += len(x)
        if i + 1 >= max_batches:
            break
    return n / (time.perf_counter() - t0)


def data_wait_share(loader, steps: int, device) -> tuple[float, float]:
    """(share of step time spent in next(loader), mean step seconds) for a small tokenizer + predictor."""
    import torch

    from finetune.utils.training_utils import predictor_loss
    from model import Kronos, KronosTokenizer

    tok = KronosTokenizer(6, 32, 2, 64, 2, 2, 0.0, 0.0, 0.0, 6, 6, 0.05, 1.0, 1.1, 0.05, 4).to(device).eval()
    pred = Kronos(6, 6, 2, 64, 4, 128, 0.0, 0.0, 0.0, 0.0, True).to(device)
    opt = torch.optim.AdamW(pred.parameters(), lr=1e-3)
    waited, total, it = 0.0, 0.0, iter(loader)
    for step in range(steps + 2):  # 2 warm-up steps are not counted
        t0 = time.perf_counter()
        x, stamp = next(it)
        x, stamp = x.to(device), stamp.to(device)  # (B, W, 6) float32, (B, W, 5) int64
        t1 = time.perf_counter()
        loss, _ = predictor_loss(pred, tok, x, stamp)  # the engine's training objective
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if step >= 2:
            waited += t1 - t0
            total += t2 - t0
    return waited / total, total / steps


def stacked_frame(symbols: int, days: int, seed: int = 0) -> pd.DataFrame:
    """Qlib-like D.features output: index (instrument, datetime), columns $open ... $vwap."""
    rng = np.random.default_rng(seed)
    dates = pd.bdate_range("2011-01-03", periods=days)
    close = 10 * np.exp(np.cumsum(rng.normal(0, 0.02, (symbols, days)), axis=1)).ravel()
    codes = [f"SH{600000 + i}" for i in range(symbols)]
    index = pd.MultiIndex.from_product([codes, dates], names=["instrument", "datetime"])
    return pd.DataFrame({"$open": close * 1.001, "$high": close * 1.01, "$low": close * 0.99, "$close": close,
                         "$volume": rng.uniform(1e5, 1e6, len(close)), "$vwap": close}, index=index)


def original_preprocess(frame: pd.DataFrame, symbols: list[str]) -> list[pd.DataFrame]:
    """The original's loop: unstack, then one pivot per symbol, derived columns, dropna."""
    frame = frame.swaplevel().sort_index()  # QlibDataLoader's layout: (datetime, instrument)
    data = frame.stack().unstack(level=1)  # (datetime, field) x symbol, as the original reshapes it
    out = []
    for symbol in symbols:
        df = data[symbol].reset_index().rename(columns={"level_1": "field"})
        df = pd.pivot(df, index="datetime", columns="field", values=symbol)
        df = df.rename(columns={f"${f}": f for f in ("open", "high", "low", "close", "volume", "vwap")})
        df["amount"] = (df["open"] + df["high"] + df["low"] + df["close"]) / 4 * df["volume"]
        out.append(df[list(FEATURES)].dropna())
    return out


def qlib_bench(args: argparse.Namespace) -> None:
    from finetune.config import load
    from finetune.dataset import build_window_dataset
    from finetune.qlib_io import frame_to_panel

    frame = stacked_frame(args.symbols, args.days)
    print(f"data: {args.symbols} symbols x {args.days} daily bars = {len(frame):,} rows")
    t = time.perf_counter()
    panel, _ = frame_to_panel(frame, "ohlc_mean", min_bars=QLIB_LOOKBACK)
    ours_pre = time.perf_counter() - t
    names = list(frame.index.get_level_values(0).unique()[: args.baseline_symbols])
    t = time.perf_counter()
    frames = original_preprocess(frame.loc[names], names)
    base_pre = (time.perf_counter() - t) * args.symbols / len(names)
    frames = [pd.concat([f.reset_index(drop=True), calc_time_stamps(f.index)], axis=1) for f in frames]  # at init

    cfg = load(None, [f"data.lookback={QLIB_LOOKBACK}", f"data.predict={QLIB_PREDICT}"])
    ds = build_window_dataset(panel, cfg, "train")
    rng = np.random.default_rng(0)
    baseline = PandasIlocWindows(frames, QLIB_LOOKBACK, QLIB_PREDICT)
    rows = [
        ("original: pandas per sample", rate(lambda: baseline[int(rng.integers(len(baseline)))], args.seconds)),
        ("ours: WindowDataset[i] per sample", rate(lambda: ds[int(rng.integers(len(ds)))], args.seconds)),
        (f"ours: batched fetch (batch {args.batch})",
         rate(lambda: ds.get_batch(rng.integers(len(ds), size=args.batch)), args.seconds, args.batch)),
    ]
    print(f"\npreprocess (frame -> per-instrument arrays), {args.symbols} symbols:")
    print(f"  original pivot loop : {base_pre:8.2f} s  (timed on {len(names)} symbols, scaled)")
    print(f"  ours (one sort)     : {ours_pre:8.2f} s  ({base_pre / ours_pre:.0f}x faster)")
    print(f"\ntraining samples/s (window {QLIB_LOOKBACK}+{QLIB_PREDICT}, {len(ds):,} windows):")
    base = rows[0][1]
    for name, value in rows:
        print(f"  {name:38s} {value:12,.0f}   {value / base:6.1f}x")


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


def series_frame(i: int, bars: int):
    """One synthetic 5-minute series as an Arrow table (random walk OHLCV; timestamps typed, naive)."""
    import pyarrow as pa

    rng = np.random.default_rng(i)
    close = 100.0 * np.exp(np.cumsum(rng.normal(0, 0.002, bars)))
    open_ = np.concatenate([[close[0]], close[:-1]])
    spread = np.abs(rng.normal(0, 0.001, bars)) * close
    volume = rng.integers(100, 10_000, bars).astype(np.float64)
    ts = START_NS + np.arange(bars, dtype=np.int64) * BAR_NS
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
    for i in range(series):
        pq.write_table(series_frame(i, bars), folder / f"S{i:05d}.parquet")
    marker.write_text(json.dumps(want))
    print(f"generated {series} x {bars} bars as Parquet in {time.perf_counter() - t0:.1f} s", flush=True)


def worker(data: str, store: str, lookback: int, predict: int, batch: int) -> None:
    t0 = float(os.environ[T0_ENV])
    mem = PeakMemory()
    import torch

    from finetune.utils.distributed import barrier, distributed_context
    from finetune.utils.training_utils import tokenizer_loss
    from finetune.utils.windows import EpochSampler
    from finetune_csv.prepare import ensure_store
    from finetune_csv.splits import split_panel
    from model import KronosTokenizer
    from model.config import Window

    window = Window(lookback, predict)

    torch.set_num_threads(1)
    out: dict = {}
    with distributed_context(timeout_s=3600) as dist:
        t_import = time.time() - t0
        info = ensure_store(data, store, dist=dist, barrier=barrier)
        panel = info.open()
        t_store = time.time() - t0
        anon_store = mem.sample()["RssAnon"]
        train = split_panel(panel, 0.9, 0.1, 0.0, window)["train"].dataset(window)
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
        tokenizer_loss(model, x)[0].backward()
        opt.step()
        t_step = time.time() - t0
        out = {"rank": dist.rank, "reused": info.reused, "reason": info.reason, "n_rows": panel.n_rows,
               "n_series": panel.n_series, "train_windows": len(train), "t_import_s": t_import,
               "t_store_ready_s": t_store, "t_sampler_s": t_sampler, "t_batch_s": t_batch, "t_first_step_s": t_step,
               "anon_after_store_mib": anon_store, "anon_after_sampler_mib": anon_sampler,
               "prepare_seconds": info.manifest.get("prepare_seconds") if not info.reused else None}
    out.update(mem.stop())
    print("RESULT " + json.dumps(out), flush=True)


def run_torchrun(args: argparse.Namespace, data: Path, store: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "finetune.benchmarks.data", "store", "--worker", "--data", str(data), "--store", str(store),
           "--lookback", str(args.lookback), "--predict", str(args.predict), "--batch", str(args.batch)]
    env = {**os.environ, T0_ENV: repr(time.time()), "DIST_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    job = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if job.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{job.stdout[-3000:]}\n{job.stderr[-5000:]}")
    results = [json.loads(line[7:]) for line in job.stdout.splitlines() if line.startswith("RESULT ")]
    return sorted(results, key=lambda r: r["rank"])


def measure_prepare(kind: str, path: str, out: str) -> None:
    import resource

    from finetune_csv.config import DataConfig
    from finetune_csv.prepare import prepare_store
    from tests.csv_reference import load_series  # the in-memory pandas loader (a reference, not production)

    t0 = time.perf_counter()  # imports are not timed
    if kind == "pandas":
        rows = sum(len(s.values) for s in load_series(DataConfig(path=path)))
    else:
        rows = prepare_store(path, out).manifest["n_rows"]
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"kind": kind, "rows": rows, "seconds": seconds, "peak_rss_mib": rss}), flush=True)


def prepare_throughput(root: Path, rows: int, bars: int) -> list[dict]:
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    series = max(1, rows // bars)
    csv_dir, pq_dir = root / "baseline_csv", root / "baseline_parquet"
    for d in (csv_dir, pq_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    for i in range(series):
        table = series_frame(i, bars)
        pq.write_table(table, pq_dir / f"S{i:05d}.parquet")
        # timestamps as 'YYYY-MM-DD HH:MM:SS' text, the usual CSV form
        text = table.set_column(0, "timestamps", table.column(0).cast("timestamp[s]").cast("string"))
        pa_csv.write_csv(text, csv_dir / f"S{i:05d}.csv")
    results = []
    for kind, path in (("pandas", csv_dir), ("store_csv", csv_dir), ("store_parquet", pq_dir)):
        out = root / f"baseline_store_{kind}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "finetune.benchmarks.data", "store", "--measure", kind, "--data", str(path),
               "--store", str(out)]
        job = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if job.returncode != 0:
            raise SystemExit(f"{kind} failed:\n{job.stderr[-3000:]}")
        results += [json.loads(line[7:]) for line in job.stdout.splitlines() if line.startswith("RESULT ")]
        shutil.rmtree(out, ignore_errors=True)
    return results


def store_bench(args: argparse.Namespace) -> None:
    if args.worker:
        return worker(args.data, args.store, args.lookback, args.predict, args.batch)
    if args.measure:
        return measure_prepare(args.measure, args.data, args.store)
    root = Path(args.data_dir)
    bars = args.rows // args.series
    data, store = root / "parquet", root / "store"
    generate_parquet(data, args.series, bars)
    shutil.rmtree(store, ignore_errors=True)
    runs = {"first run (prepare)": run_torchrun(args, data, store),
            "re-run (reuse)": run_torchrun(args, data, store)}
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
            prep = "" if r["prepare_seconds"] is None else f"{r['prepare_seconds']:.1f}"
            print(f"| {name} | {r['rank']} | {r['t_import_s']:.1f} | {r['t_store_ready_s']:.1f} | "
                  f"{r['t_sampler_s']:.1f} | {r['t_batch_s']:.1f} | "
                  f"{r['t_first_step_s']:.1f} | {r['peak_anon_mib']:.0f} | {r['anon_after_sampler_mib']:.0f} | "
                  f"{r['peak_file_mib']:.0f} | {prep} |")
    if args.baseline_rows:
        results = prepare_throughput(root, args.baseline_rows, bars)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    windows = argparse.ArgumentParser(add_help=False)  # the window and batch of the csv and store benchmarks
    windows.add_argument("--lookback", type=int, default=512)
    windows.add_argument("--predict", type=int, default=48)
    windows.add_argument("--batch", type=int, default=32)
    p = sub.add_parser("csv", parents=[windows],
                       help="the CSV pipeline's store + WindowDataset against pandas .iloc per sample")
    p.add_argument("--series", type=int, default=8)
    p.add_argument("--bars", type=int, default=20_000)
    p.add_argument("--batches", type=int, default=60, help="batches timed per loader")
    p.add_argument("--steps", type=int, default=20, help="train steps timed for the data-wait share")
    p = sub.add_parser("qlib", help="the Qlib preprocessing and window dataset against the original's pandas loop")
    p.add_argument("--symbols", type=int, default=300)
    p.add_argument("--days", type=int, default=3600, help="daily bars per symbol (3600 ~ 15 years)")
    p.add_argument("--baseline-symbols", type=int, default=30, help="symbols the original's pivot loop is timed on")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--seconds", type=float, default=3.0, help="time per samples/s measurement")
    p = sub.add_parser("store", parents=[windows],
                       help="the memory-mapped store under torchrun, and preparation throughput")
    p.add_argument("--rows", type=int, default=100_000_000, help="total rows of the synthetic Parquet folder")
    p.add_argument("--series", type=int, default=2000, help="series (one Parquet file each)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--data-dir", default="/tmp/kronos_store_bench")
    p.add_argument("--baseline-rows", type=int, default=1_000_000, help="rows for the throughput comparison; 0 skips")
    p.add_argument("--keep", action="store_true", help="keep the generated data and the store")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    {"csv": csv_bench, "qlib": qlib_bench, "store": store_bench}[args.bench](args)


if __name__ == "__main__":
    from finetune.utils.errors import run_main  # clean errors and exit codes (finetune/utils/errors.py)

    sys.exit(run_main(main))
