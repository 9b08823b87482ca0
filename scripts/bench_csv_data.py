"""Benchmark the CSV pipeline's data path: samples/s against a per-sample pandas baseline, and data-wait share.

    python scripts/bench_csv_data.py [--series 8 --bars 20000 --lookback 512 --predict 48 --batch 32]

1. Samples/s through a DataLoader (num_workers=0, batch `--batch`, shuffled) of
   a. the CSV pipeline's data path: the prepared, memory-mapped store (finetune_csv.data.prepare_data) and
      its train split's dataset (finetune_csv.data.build_dataset -> finetune.utils WindowDataset: one vectorised
      gather and normalisation per batch from the memory map), and
   b. a baseline written the way per-sample pipelines usually are (the original Kronos CSV dataset among them):
      `df.iloc[start:start + window]` per sample on a pandas DataFrame per series, then numpy normalisation.
2. Share of train-step wall time spent waiting for the next batch, for a small predictor on this CPU/GPU
   (tokenizer encode + predictor forward/backward + AdamW step per batch).
Synthetic data (finetune.synthetic) is written to a temporary folder and prepared into a store there (the time to
parse, check and write it is reported); the baseline's DataFrames hold the same train rows, copied from the store.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset

from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune.utils.windows import EpochSampler, make_loader
from finetune_csv.config import DataConfig
from finetune_csv.data import build_dataset, prepare_data
from model import Kronos, KronosTokenizer
from model.features import FEATURES, TIME_FEATURES


class PandasIlocWindows(Dataset):
    """The baseline: one pandas DataFrame per series, `.iloc` slice + normalisation per sample."""

    def __init__(self, frames: list[pd.DataFrame], lookback: int, predict: int, clip: float):
        self.frames, self.lookback, self.window, self.clip = frames, lookback, lookback + predict, clip
        counts = [max(0, len(f) - self.window + 1) for f in frames]
        self.index = [(i, s) for i, n in enumerate(counts) for s in range(n)]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int):
        series, start = self.index[idx]
        window = self.frames[series].iloc[start: start + self.window]
        x = window[list(FEATURES)].to_numpy(dtype=np.float32)
        stamp = window[list(TIME_FEATURES)].to_numpy(dtype=np.int64)
        mean, std = x[: self.lookback].mean(0), x[: self.lookback].std(0)
        x = np.clip((x - mean) / (std + 1e-5), -self.clip, self.clip)
        return torch.from_numpy(x), torch.from_numpy(stamp)


def samples_per_second(loader, max_batches: int) -> float:
    n, t0 = 0, time.perf_counter()
    for i, (x, _) in enumerate(loader):
        n += len(x)
        if i + 1 >= max_batches:
            break
    return n / (time.perf_counter() - t0)


def data_wait_share(loader, steps: int, device: torch.device) -> tuple[float, float]:
    """(share of step time spent in next(loader), mean step seconds) for a small tokenizer + predictor."""
    tok = KronosTokenizer(6, 32, 2, 64, 2, 2, 0.0, 0.0, 0.0, 6, 6, 0.05, 1.0, 1.1, 0.05, 4).to(device).eval()
    pred = Kronos(6, 6, 2, 64, 4, 128, 0.0, 0.0, 0.0, 0.0, True).to(device)
    opt = torch.optim.AdamW(pred.parameters(), lr=1e-3)
    waited, total, it = 0.0, 0.0, iter(loader)
    for step in range(steps + 2):  # 2 warm-up steps are not counted
        t0 = time.perf_counter()
        x, stamp = next(it)
        x, stamp = x.to(device), stamp.to(device)
        t1 = time.perf_counter()
        with torch.no_grad():
            s1, s2 = tok.encode(x, half=True)
        s1_logits, s2_logits = pred(s1[:, :-1], s2[:, :-1], stamp[:, :-1], use_teacher_forcing=True,
                                    s1_targets=s1[:, 1:])
        loss, _, _ = pred.head.compute_loss(s1_logits, s2_logits, s1[:, 1:], s2[:, 1:])
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--series", type=int, default=8)
    p.add_argument("--bars", type=int, default=20_000)
    p.add_argument("--lookback", type=int, default=512)
    p.add_argument("--predict", type=int, default=48)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=60, help="batches timed per loader")
    p.add_argument("--steps", type=int, default=20, help="train steps timed for the data-wait share")
    args = p.parse_args(argv)
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

        frames = []
        for lo, hi in zip(train.start.tolist(), train.stop.tolist()):
            f = pd.DataFrame(np.asarray(data.panel.features[:, lo:hi]).T, columns=list(FEATURES))  # (n, 6)
            f[list(TIME_FEATURES)] = np.asarray(data.panel.stamps[lo:hi])
            frames.append(f)
        baseline = PandasIlocWindows(frames, args.lookback, args.predict, cfg.clip)
        assert len(baseline) == len(ours), (len(baseline), len(ours))
        run_loaders(args, ours, baseline, load_s, build_s)


def run_loaders(args, ours, baseline, load_s: float, build_s: float) -> None:
    """Time both loaders and the data-wait share of a train step; print the table (the store is still mapped)."""
    sampler = EpochSampler(len(ours), shuffle=True, seed=0)
    ours_loader = make_loader(ours, sampler, args.batch, epoch=0, seed=0)
    base_loader = DataLoader(baseline, batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    ours_sps = samples_per_second(ours_loader, args.batches)
    base_sps = samples_per_second(base_loader, max(5, args.batches // 6))

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ours_wait, ours_step = data_wait_share(make_loader(ours, sampler, args.batch, epoch=1, seed=0), args.steps, device)
    base_wait, base_step = data_wait_share(
        DataLoader(baseline, batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(1)),
        args.steps, device)

    print(f"data: {args.series} series x {args.bars} bars (5min), {len(ours)} training windows of "
          f"{args.lookback}+{args.predict}; prepare the store (parse+check CSVs) {load_s:.2f} s, "
          f"split + dataset {build_s:.2f} s")
    print(f"device for the train step: {device}, torch threads {torch.get_num_threads()}, batch {args.batch}")
    print(f"{'loader':<34}{'samples/s':>12}{'speed-up':>10}{'data wait':>12}{'step ms':>10}")
    print(f"{'pandas .iloc per sample (baseline)':<34}{base_sps:>12,.0f}{1.0:>9.1f}x{100 * base_wait:>11.1f}%"
          f"{1000 * base_step:>10.1f}")
    print(f"{'store + WindowDataset (batches)':<34}{ours_sps:>12,.0f}{ours_sps / base_sps:>9.1f}x"
          f"{100 * ours_wait:>11.1f}%{1000 * ours_step:>10.1f}")


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # clean errors and exit codes (finetune/utils/errors.py)

    sys.exit(run_main(main))
