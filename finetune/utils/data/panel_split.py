"""Per-series time splits of a `SeriesPanel` as index ranges (no copies), read by the shared `WindowDataset`.

    splits = split_panel(panel, train_ratio=0.9, val_ratio=0.1, test_ratio=0.0, lookback=512, predict=48)
    train = splits["train"].dataset(lookback=512, predict=48, stride=1, clip=5.0)   # a WindowDataset
    x, x_stamp = train.get_batch(indices)    # (B, W, F) float32 normalised, (B, W, 5) int64

A split of series s is the column range [start, stop) of the panel; for val/test `start` lies `lookback` rows
before the split's first own row (`first_target`), so the split's first window predicts its first row, and no
window crosses into another series. With a memory-mapped panel nothing is copied until a batch is gathered: a
batch reads B windows from the map (`WindowDataset(panel, ranges=(start, stop))`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .panel import SeriesPanel
from .window_dataset import WindowDataset

__all__ = ["PanelSegments", "split_bounds", "split_panel"]

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class PanelSegments:
    """The rows of each series one split may read, as panel column ranges (arrays of shape (S,), int64)."""

    panel: SeriesPanel
    """The whole panel (possibly memory-mapped); never copied."""
    start: np.ndarray
    """First column a window of this split may read, per series."""
    first_target: np.ndarray
    """First column that belongs to the split itself (columns before it are context), per series."""
    stop: np.ndarray
    """One past the split's last column, per series."""

    def lengths(self) -> np.ndarray:
        """Readable rows per series (context included), int64 (S,)."""
        return self.stop - self.start

    def dataset(self, lookback: int, predict: int, *, stride: int = 1, clip: float = 5.0) -> WindowDataset:
        """The split's windows: the shared WindowDataset reading the panel (memory map) inside these ranges."""
        return WindowDataset(self.panel, lookback, predict, stride=stride, clip=clip,
                             ranges=(self.start, self.stop))


def split_bounds(n_rows: int, train_ratio: float, val_ratio: float) -> tuple[int, int]:
    """Row indices (train_end, val_end) of a series of n_rows (the CSV pipeline's rounding)."""
    train_end = int(n_rows * train_ratio)
    val_end = int(round(n_rows * (train_ratio + val_ratio), 9))  # round(): 0.7 + 0.2 must not lose a row
    return train_end, val_end


def split_panel(panel: SeriesPanel, train_ratio: float, val_ratio: float, test_ratio: float, lookback: int,
                predict: int) -> dict[str, PanelSegments]:
    """Cut every series by time into train / val / (test when test_ratio > 0) index ranges.

    Raises ValueError naming each series too short to give one window per split (train needs lookback + predict
    rows, val and test need predict rows of their own).
    """
    lengths = panel.lengths()
    offsets = np.asarray(panel.offsets, dtype=np.int64)
    bounds = np.array([split_bounds(int(n), train_ratio, val_ratio) for n in lengths], dtype=np.int64).reshape(-1, 2)
    train_end, val_end = bounds[:, 0], bounds[:, 1]
    short = (train_end < lookback + predict) | (val_end - train_end < predict)
    if test_ratio > 0:
        short |= lengths - val_end < predict
    if short.any():
        listed = [f"{panel.names[i]}: {int(lengths[i])} rows" for i in np.flatnonzero(short)[:10]]
        more = f" (+{int(short.sum()) - 10} more)" if short.sum() > 10 else ""
        raise ValueError(f"{int(short.sum())} series too short for one window per split with data.lookback="
                         f"{lookback}, data.predict={predict} and ratios {train_ratio}/{val_ratio}/{test_ratio}: "
                         f"{', '.join(listed)}{more}; lower data.lookback / data.predict, change the ratios, or "
                         "remove these series")
    first = offsets[:-1]
    out = {"train": PanelSegments(panel, first, first, first + train_end),
           "val": PanelSegments(panel, first + train_end - lookback, first + train_end, first + val_end)}
    if test_ratio > 0:
        out["test"] = PanelSegments(panel, first + val_end - lookback, first + val_end, first + lengths)
    return out
