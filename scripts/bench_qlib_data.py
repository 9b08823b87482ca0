"""Benchmark the Qlib pipeline's data path against the per-sample pandas approach of the original scripts.

    python scripts/bench_qlib_data.py [--symbols 300 --days 3600 --batch 50 --seconds 3]

Synthetic CSI-300-sized data (symbols x days of daily bars, in Qlib's stacked layout) is used for both sides:
  preprocess   stacked frame -> per-instrument arrays: ours (one sort, offsets, numpy) vs the original
               (a pandas pivot per symbol in a Python loop; timed on --baseline-symbols and scaled up)
  samples/s    training windows (lookback 90 + predict 10, normalised): the original's per-sample
               DataFrame.iloc + numpy, ours per sample (__getitem__), and ours batched (get_batch, what the
               DataLoader calls with a batch of indices)
Prints one table; the numbers depend on the machine (run on an idle one).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from finetune.config import load
from finetune.dataset import build_window_dataset
from finetune.qlib_io import frame_to_panel

LOOKBACK, PREDICT = 90, 10


def stacked_frame(symbols: int, days: int, seed: int = 0) -> pd.DataFrame:
    """Qlib-like D.features output: index (instrument, datetime), columns $open ... $vwap."""
    rng = np.random.default_rng(seed)
    dates = pd.bdate_range("2011-01-03", periods=days)
    close = 10 * np.exp(np.cumsum(rng.normal(0, 0.02, (symbols, days)), axis=1)).ravel()
    codes = [f"SH{600000 + i}" for i in range(symbols)]
    index = pd.MultiIndex.from_product([codes, dates], names=["instrument", "datetime"])
    return pd.DataFrame({"$open": close * 1.001, "$high": close * 1.01, "$low": close * 0.99, "$close": close,
                         "$volume": rng.uniform(1e5, 1e6, len(close)), "$vwap": close}, index=index)


def original_preprocess(frame: pd.DataFrame, symbols: list[str]) -> dict[str, pd.DataFrame]:
    """The original's loop: unstack, then one pivot per symbol, derived columns, dropna."""
    frame = frame.swaplevel().sort_index()  # QlibDataLoader's layout: (datetime, instrument)
    data = frame.stack().unstack(level=1)  # (datetime, field) x symbol, as the original reshapes it
    out = {}
    for symbol in symbols:
        df = data[symbol].reset_index().rename(columns={"level_1": "field"})
        df = pd.pivot(df, index="datetime", columns="field", values=symbol)
        df = df.rename(columns={f"${f}": f for f in ("open", "high", "low", "close", "volume", "vwap")})
        df["vol"] = df["volume"]
        df["amt"] = (df["open"] + df["high"] + df["low"] + df["close"]) / 4 * df["vol"]
        out[symbol] = df[["open", "high", "low", "close", "vol", "amt"]].dropna()
    return out


class PandasPerSample:
    """The original's training sample: random (symbol, start), DataFrame.iloc window, time features, z-score."""

    def __init__(self, frames: dict[str, pd.DataFrame], seed: int = 0):
        self.window = LOOKBACK + PREDICT
        self.frames, self.indices = {}, []
        for symbol, df in frames.items():
            df = df.reset_index()
            for name, values in (("minute", df.datetime.dt.minute), ("hour", df.datetime.dt.hour),
                                 ("weekday", df.datetime.dt.day_of_week), ("day", df.datetime.dt.day),
                                 ("month", df.datetime.dt.month)):
                df[name] = values
            self.frames[symbol] = df
            self.indices += [(symbol, i) for i in range(len(df) - self.window + 1)]
        self.rng = np.random.default_rng(seed)

    def sample(self):
        symbol, start = self.indices[self.rng.integers(len(self.indices))]
        win = self.frames[symbol].iloc[start : start + self.window]
        x = win[["open", "high", "low", "close", "vol", "amt"]].to_numpy(np.float32)
        stamp = win[["minute", "hour", "weekday", "day", "month"]].to_numpy(np.float32)
        mean, std = x.mean(0), x.std(0)
        return np.clip((x - mean) / (std + 1e-5), -5, 5), stamp


def rate(fn, seconds: float, per_call: int = 1) -> float:
    """Calls of `fn` per second over about `seconds` (after one warm-up call), times `per_call`."""
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return n * per_call / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--symbols", type=int, default=300)
    p.add_argument("--days", type=int, default=3600, help="daily bars per symbol (3600 ~ 15 years)")
    p.add_argument("--baseline-symbols", type=int, default=30, help="symbols the original's pivot loop is timed on")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--seconds", type=float, default=3.0, help="time per samples/s measurement")
    args = p.parse_args(argv)

    frame = stacked_frame(args.symbols, args.days)
    print(f"data: {args.symbols} symbols x {args.days} daily bars = {len(frame):,} rows")

    t = time.perf_counter()
    panel, _ = frame_to_panel(frame, "ohlc_mean", min_bars=LOOKBACK)
    ours_pre = time.perf_counter() - t
    names = list(frame.index.get_level_values(0).unique()[: args.baseline_symbols])
    t = time.perf_counter()
    frames = original_preprocess(frame.loc[names], names)
    base_pre = (time.perf_counter() - t) * args.symbols / len(names)

    cfg = load(None, [f"data.lookback={LOOKBACK}", f"data.predict={PREDICT}"])
    ds = build_window_dataset(panel, cfg, "train")
    rng = np.random.default_rng(0)
    baseline = PandasPerSample(frames)
    rows = [
        ("original: pandas per sample", rate(baseline.sample, args.seconds)),
        ("ours: WindowDataset[i] per sample", rate(lambda: ds[int(rng.integers(len(ds)))], args.seconds)),
        (f"ours: batched fetch (batch {args.batch})",
         rate(lambda: ds.get_batch(rng.integers(len(ds), size=args.batch)), args.seconds, args.batch)),
    ]
    print(f"\npreprocess (frame -> per-instrument arrays), {args.symbols} symbols:")
    print(f"  original pivot loop : {base_pre:8.2f} s  (timed on {len(names)} symbols, scaled)")
    print(f"  ours (one sort)     : {ours_pre:8.2f} s  ({base_pre / ours_pre:.0f}x faster)")
    print(f"\ntraining samples/s (window {LOOKBACK}+{PREDICT}, {len(ds):,} windows):")
    base = rows[0][1]
    for name, value in rows:
        print(f"  {name:38s} {value:12,.0f}   {value / base:6.1f}x")


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # clean errors and exit codes (finetune/utils/errors.py)

    sys.exit(run_main(main))
