"""Benchmark: forecasting with today's eager cached generator against the static decoding step (`decode="static"`)
and, on CUDA, the same step recorded as one CUDA graph (`decode="graph"`), in one run.

Kronos-small + Kronos-Tokenizer-base shapes (randomly initialised: timing does not depend on the weights), greedy
decoding so every path must produce the same forecast, which is checked. Four workloads (issues 27, 34):
    one    1 series, context 400 -> 120 steps (the last 8 slide the window: full re-encodes in every path)
    few    8 series x 2 sample paths, context 128 -> 24
    many   300 series, context 90 -> 10 (one day of a CSI 300 backtest)
    paths  64 series x 8 sample paths, context 400 -> 24 (the static step encodes each context once, not 8 times)
Without CUDA the defaults are small (--quick: about a minute on 2 CPU cores); --full runs the issue's sizes.
--host times what `predict_batch` does outside the model (checks, cut, normalisation, time features, results as
DataFrames) for 300 DataFrames of 90 daily bars -> 10, with the model replaced by a stub that returns at once: the
CPU stand-in of the 300-series target (issue 34: <= 100 ms on 2 cores).

    python -m finetune.benchmarks.generation                 # quick on CPU, full on CUDA
    python -m finetune.benchmarks.generation --full --repeats 3
    python -m finetune.benchmarks.generation --host          # PYTHONPATH=<another checkout> times that one's host side
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from model import Kronos, KronosPredictor, KronosTokenizer
from model.config import KronosConfig, KronosTokenizerConfig

TOKENIZER_BASE = asdict(KronosTokenizerConfig())  # the published Kronos-Tokenizer-base
KRONOS_SMALL = asdict(KronosConfig(s1_bits=10, s2_bits=10))  # the published Kronos-small
# name: (series, sample paths, context, steps), full and quick
WORKLOADS = {"one": ((1, 1, 400, 120), (1, 1, 64, 24)), "few": ((8, 2, 128, 24), (2, 2, 64, 12)),
             "many": ((300, 1, 90, 10), (8, 1, 90, 10)),
             "paths": ((64, 8, 400, 24), (2, 8, 64, 12))}


def inputs(series: int, context: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normalised random-walk contexts (B, N, 6) and calendar stamps (B, N, 5), (B, steps, 5)."""
    rng = np.random.default_rng(0)
    x = np.cumsum(rng.normal(0, 0.1, (series, context, 6)), axis=1).astype(np.float32)
    x = (x - x.mean(axis=1, keepdims=True)) / (x.std(axis=1, keepdims=True) + 1e-5)
    t = np.arange(context + steps)
    stamps = np.stack([t % 12 * 5, 9 + t // 12 % 7, t // 84 % 5, 1 + t // 84 % 28, np.full_like(t, 3)], axis=-1)
    stamps = np.broadcast_to(stamps, (series, context + steps, 5)).astype(np.float32)
    return x, stamps[:, :context], stamps[:, context:]


def timed(kp: KronosPredictor, decode: str, work, samples: int, repeats: int) -> tuple[float, np.ndarray]:
    """Best of `repeats` greedy forecasts after one warm-up (which also records the graph)."""
    kp.decode = decode
    sync = torch.cuda.synchronize if kp.device.type == "cuda" else (lambda: None)
    best, out = float("inf"), None
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        out = kp.generate(*work, top_k=1, sample_count=samples)
        sync()
        best = best if i == 0 else min(best, time.perf_counter() - t0)
    return best, out


def host_side(repeats: int, json_path: Path | None) -> None:
    """Process-CPU milliseconds of predict_batch for 300 frames of 90 bars -> 10, the model stubbed out."""
    import pandas as pd

    torch.set_num_threads(1)
    kp = KronosPredictor.from_models(Kronos(**KRONOS_SMALL), KronosTokenizer(**TOKENIZER_BASE), device="cpu")
    kp.generate = lambda x, x_stamp, y_stamp, steps, *a, **k: np.zeros((len(x), 1, steps, 6), np.float32)
    rng, idx = np.random.default_rng(0), pd.bdate_range("2023-01-02", periods=100)
    frames = []
    for _ in range(300):
        c = 10 * np.exp(np.cumsum(rng.normal(0, 0.01, 100)))
        frames.append(pd.DataFrame({"open": c, "high": c * 1.01, "low": c * 0.99, "close": c, "volume": 1e5 + c,
                                    "amount": 1e6 + c}, index=idx).iloc[:90])
    times = []
    for _ in range(repeats + 1):
        t0 = time.process_time()
        kp.predict_batch(frames, [idx[:90]] * 300, [idx[90:]] * 300, 10, verbose=False)
        times.append(1000 * (time.process_time() - t0))
    times = sorted(times[1:])
    print(f"host side of predict_batch, 300 series 90 -> 10, model stubbed: min {times[0]:.0f} ms, median "
          f"{times[len(times) // 2]:.0f} ms over {len(times)} runs (process CPU time, 1 thread)")
    if json_path:
        json_path.write_text(json.dumps({"min_ms": times[0], "median_ms": times[len(times) // 2]}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small workloads (the default without CUDA)")
    size.add_argument("--full", action="store_true", help="the issue's workloads (the default on CUDA)")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1, help="best of N timings per path (after one warm-up)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--host", action="store_true", help="time predict_batch's host side only (model stubbed)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    if args.host:
        return host_side(max(args.repeats, 10), args.json)

    torch.manual_seed(0)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kp = KronosPredictor.from_models(Kronos(**KRONOS_SMALL), KronosTokenizer(**TOKENIZER_BASE), device=device,
                                    max_context=args.max_context)
    full = args.full or (device.startswith("cuda") and not args.quick)
    fast = ["static", "graph"] if device.startswith("cuda") else ["static"]
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"
    print(f"Forecast, Kronos-small + Tokenizer-base shapes, greedy, max_context {args.max_context}, "
          f"{'full' if full else 'quick'} workloads, device {name}, torch {torch.__version__}")
    print(f"| workload | series x paths | context -> steps | eager s | {' | '.join(f'{d} s' for d in fast)} | "
          f"{' | '.join(f'eager / {d}' for d in fast)} | identical |")
    print("|---|---|---|---|" + "---|" * 2 * len(fast) + "---|")
    differ, rows = False, []
    for wl in args.workloads:
        series, samples, context, steps = WORKLOADS[wl][0 if full else 1]
        work = (*inputs(series, context, steps), steps)  # x, x_stamp, y_stamp, pred_len
        t_eager, ref = timed(kp, "eager", work, samples, args.repeats)
        runs = [timed(kp, d, work, samples, args.repeats) for d in fast]
        same = all(np.array_equal(ref, out) for _, out in runs)
        differ |= not same
        rows.append({"workload": wl, "series": series, "paths": samples, "context": context, "steps": steps,
                     "eager_s": t_eager, **{f"{d}_s": t for d, (t, _) in zip(fast, runs)}, "identical": same})
        print(f"| {wl} | {series} x {samples} | {context} -> {steps} | {t_eager:.3f} | "
              f"{' | '.join(f'{t:.3f}' for t, _ in runs)} | {' | '.join(f'{t_eager / t:.2f}x' for t, _ in runs)} | "
              f"{same} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    if differ:
        raise SystemExit("the static or graph forecast differs from the eager one")


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # clean errors and exit codes (finetune/utils/errors.py)

    sys.exit(run_main(main))
