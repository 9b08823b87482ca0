"""Tiny models and data for the engine tests, and a worker the tests launch (directly or under torchrun).

    python tests/engine_dist_worker.py <stage> <out_dir> [--set key=value ...]

trains a width-16 tokenizer (stage=tokenizer) or predictor (stage=predictor) on a deterministic random-walk data set
with the shared engine, then writes <out_dir>/final_state.pt (the trained weights) and <out_dir>/result.json on
rank 0. The fault-injection variables of finetune.utils.training_utils (KRONOS_FAULT_*) make it die mid-run;
`--batch-seconds S` makes every batch fetch take S seconds (time for a test to kill it mid-run). A run stopped by
SIGTERM/SIGINT prints the one-line message and exits with 75, as the entry points do.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from finetune.utils.config_utils import load_config
from finetune.utils.distributed import distributed_context, seed_everything
from finetune.utils.errors import TrainingStopped
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import train_predictor, train_tokenizer
from finetune.utils.windows import SeriesArrays, WindowDataset
from model.config import Window

try:  # imported by the tests as tests.engine_dist_worker, or run as a script (tests/ is then on sys.path)
    from tests import model_factory
except ImportError:
    import model_factory
tiny_tokenizer = model_factory.tiny_tokenizer

LOOKBACK, PREDICT = 8, 2


# The shared tiny models (tests/model_factory.py); the engine tests use a one-layer predictor.
tiny_predictor = functools.partial(model_factory.tiny_predictor, n_layers=1)


def random_walk_series(
    n_series: int = 2, n_rows: int = 40, seed: int = 0, id_stamps: bool = False
) -> list[SeriesArrays]:
    """OHLCV-like random walks. With `id_stamps`, stamp column 0 holds the global row number (to identify windows)."""
    rng = np.random.default_rng(seed)
    out, row = [], 0
    for i in range(n_series):
        close = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, n_rows)))
        spread = np.abs(rng.normal(0, 0.005, n_rows)) * close
        volume = rng.uniform(1e3, 1e4, n_rows)
        feats = np.stack([close, close + spread, close - spread, close, volume, volume * close], axis=1)
        t = np.arange(n_rows)
        stamps = np.stack([t % 60, (t // 60) % 24, t % 7, 1 + t % 28, 1 + t % 12], axis=1).astype(np.int64)
        if id_stamps:
            stamps[:, 0] = row + t
        out.append(SeriesArrays(feats.astype(np.float32), stamps, f"S{i}"))
        row += n_rows
    return out


def tiny_datasets(n_train_rows: int = 40, n_val_rows: int = 14) -> tuple[WindowDataset, WindowDataset]:
    train = WindowDataset(random_walk_series(2, n_train_rows, seed=0), Window(LOOKBACK, PREDICT))
    val = WindowDataset(random_walk_series(1, n_val_rows, seed=1), Window(LOOKBACK, PREDICT))
    return train, val


class SlowBatches:
    """A WindowDataset whose batch fetches take `seconds` longer (the windows are unchanged)."""

    def __init__(self, inner: WindowDataset, seconds: float):
        self.inner, self.seconds = inner, seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, indices):
        return self.get_batch(indices)

    def get_batch(self, indices):
        time.sleep(self.seconds)
        return self.inner.get_batch(indices)


def main(argv: list[str]) -> int:
    try:
        return run(argv)
    except TrainingStopped as e:
        print(e, file=sys.stderr)
        return e.exit_code


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=["tokenizer", "predictor", "both"])
    parser.add_argument("out_dir")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--gamma", type=float, default=1.1, help="tokenizer codebook-entropy weight")
    parser.add_argument("--batch-seconds", type=float, default=0.0)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    defaults = ["epochs=2", "batch_size=4", "lr=1e-3", "num_workers=0", "log_every_steps=1", "progress_bar=false"]
    cfg = load_config(TrainingConfig, overrides=[*defaults, *args.set])

    with distributed_context(timeout_s=60) as dist:
        seed_everything(cfg.seed, dist.rank)
        train_set, val_set = tiny_datasets()
        if args.batch_seconds > 0:
            train_set = SlowBatches(train_set, args.batch_seconds)
        tokenizer = tiny_tokenizer(dropout=args.dropout, gamma=args.gamma)
        if args.stage in ("tokenizer", "both"):
            out = Path(args.out_dir) / "tokenizer" if args.stage == "both" else Path(args.out_dir)
            result = train_tokenizer(tokenizer, train_set, val_set, cfg, out, dist)
            _write_outputs(tokenizer, result, out, dist)
        if args.stage in ("predictor", "both"):
            out = Path(args.out_dir) / "predictor" if args.stage == "both" else Path(args.out_dir)
            predictor = tiny_predictor(dropout=args.dropout)
            result = train_predictor(predictor, tokenizer, train_set, val_set, cfg, out, dist)
            _write_outputs(predictor, result, out, dist)
    return 0


def _write_outputs(model: torch.nn.Module, result, out: Path, dist) -> None:
    if dist.is_main:
        torch.save(model.state_dict(), out / "final_state.pt")
        with open(out / "result.json", "w") as f:
            json.dump({"best_val_loss": result.best_val_loss, "history": result.history,
                       "global_step": result.global_step, "world_size": dist.world_size}, f)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
