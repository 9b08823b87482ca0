"""The CSV pipeline's time-split rules: how many rows each split of a series gets and whether it is long enough.

The data itself has one production path: the prepared, memory-mapped store (finetune_csv/prepared.py `prepare_data`:
streaming parse, every candle check - column mapping, NaN policy, time zones, frequency, float32 range - in
finetune/utils/data/data_store.py and finetune/utils/data/streaming_reader.py). Training, the held-out evaluation,
the validation CRPS and the future forecast all read it. The split boundaries are `split_bounds`
(finetune/utils/data/panel_split.py); the checks below use the same rounding. The in-memory pandas loader the store
was checked against lives in the tests (tests/csv_reference.py), as an independent reference only. """

from __future__ import annotations

from finetune.utils.config_utils import Problems
from finetune.utils.data.panel_split import split_bounds
from finetune_csv.config import DataConfig

__all__ = ["split_bounds", "split_row_counts", "split_is_usable", "min_rows_needed"]


def split_row_counts(n_rows: int, cfg: DataConfig) -> dict[str, int]:
    """Rows of each split of a series of `n_rows` (context excluded): {"train", "val", "test"}."""
    train_end, val_end = split_bounds(n_rows, cfg.train_ratio, cfg.val_ratio)
    return {"train": train_end, "val": val_end - train_end, "test": n_rows - val_end}


def split_is_usable(n_rows: int, cfg: DataConfig) -> bool:
    """Whether a series of n_rows gives at least one window in train, in val, and in test when test_ratio > 0."""
    counts = split_row_counts(n_rows, cfg)
    test_ok = cfg.test_ratio == 0 or counts["test"] >= cfg.predict
    return counts["train"] >= cfg.lookback + cfg.predict and counts["val"] >= cfg.predict and test_ok


def min_rows_needed(cfg: DataConfig) -> int:
    """Smallest series length that gives every split at least one window (see `split_is_usable`)."""
    n = cfg.lookback + cfg.predict
    while not split_is_usable(n, cfg):
        n += 1
    return n


def too_short_problems(rows: list[tuple[str, int]], cfg: DataConfig) -> Problems:
    """One Problems entry per (series name, row count) too short for a window in every split; empty when none is."""
    problems = Problems(
        f"Series too short for one window per split: each needs at least {min_rows_needed(cfg)} rows with "
        f"data.lookback={cfg.lookback}, data.predict={cfg.predict} and ratios {cfg.train_ratio}/{cfg.val_ratio}/"
        f"{cfg.test_ratio} (train needs lookback + predict rows, val and test need predict rows); "
        "lower data.lookback / data.predict, change the ratios, or remove these series")
    for name, n in rows:
        if not split_is_usable(n, cfg):
            problems.add(name, f"{n} rows {split_row_counts(n, cfg)}")
    return problems
