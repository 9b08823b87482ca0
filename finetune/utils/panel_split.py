"""Per-series time splits of a `SeriesPanel` as index ranges (no copies), and batched window reads from them.

    splits = split_panel(panel, train_ratio=0.9, val_ratio=0.1, test_ratio=0.0, lookback=512, predict=48)
    train = PanelWindows(splits["train"], lookback=512, predict=48, stride=1, clip=5.0)
    x, x_stamp = train.get_batch(indices)    # (B, W, F) float32 normalised, (B, W, 5) int64

A split of series s is the column range [start, stop) of the panel; for val/test `start` lies `lookback` rows
before the split's first own row (`first_target`), so the split's first window predicts its first row, and no
window crosses into another series. With a memory-mapped panel nothing is copied until a batch is gathered: a
batch reads B windows from the map and computes their statistics (same arithmetic as `WindowDataset.get_batch`,
so the numbers are bit-identical).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .panel import N_STAMP_COLUMNS, SeriesPanel

__all__ = ["PanelSegments", "PanelWindows", "split_bounds", "split_panel"]

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


class PanelWindows:
    """All windows of `lookback + predict` rows, every `stride` rows, inside each segment of a split.

    Index -> window is `np.searchsorted` over per-segment window counts (memory O(S), not O(windows)). Items are
    those of `WindowDataset`: x float32 (W, F) normalised with its lookback rows' mean and population std,
    clipped to [-clip, clip]; x_stamp int64 (W, 5).
    """

    def __init__(self, segments: PanelSegments, lookback: int, predict: int, *, stride: int = 1, clip: float = 5.0):
        if lookback < 1 or predict < 0 or stride < 1:
            raise ValueError(f"need lookback >= 1, predict >= 0, stride >= 1; got {lookback}, {predict}, {stride}")
        self.segments = segments
        self.lookback, self.predict, self.window = int(lookback), int(predict), int(lookback + predict)
        self.stride, self.clip = int(stride), float(clip)
        n = segments.lengths()
        counts = np.where(n >= self.window, (n - self.window) // self.stride + 1, 0).astype(np.int64)
        self.cum_windows = np.cumsum(counts)  # (S,)
        if len(self) == 0:
            raise ValueError(f"no series has enough rows for one window of {self.window} rows")
        feats, stamps = segments.panel.features, segments.panel.stamps  # (F, N), (N, 5); memmaps stay memmaps
        rows, f, w = feats.shape[1], feats.shape[0], self.window
        # Views indexed by a window's first column: (N - W + 1, F, W) and (N - W + 1, W, 5); nothing is copied.
        self._feature_windows = np.lib.stride_tricks.as_strided(
            feats, (rows - w + 1, f, w), (feats.strides[1], feats.strides[0], feats.strides[1]), writeable=False)
        self._stamp_windows = np.lib.stride_tricks.as_strided(
            stamps, (rows - w + 1, w, N_STAMP_COLUMNS), (stamps.strides[0],) + stamps.strides, writeable=False)

    def __len__(self) -> int:
        return int(self.cum_windows[-1]) if len(self.cum_windows) else 0

    def starts(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Window indices -> first panel column of each window, int64 (B,)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)})")
        seg = np.searchsorted(self.cum_windows, idx, side="right")
        before = np.where(seg > 0, self.cum_windows[np.maximum(seg - 1, 0)], 0)
        return self.segments.start[seg] + (idx - before) * self.stride

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows `indices` as one batch: x (B, W, F) float32 normalised, x_stamp (B, W, 5) int64."""
        starts = self.starts(indices)
        x = self._feature_windows[starts]  # (B, F, W): the only copy, read from the map
        past = x[:, :, : self.lookback]
        mean = past.mean(axis=2, keepdims=True)  # (B, F, 1)
        centred = past - mean
        std = np.sqrt(np.einsum("bfw,bfw->bf", centred, centred) / self.lookback)[:, :, None]  # (B, F, 1)
        x -= mean
        x /= std + 1e-5
        np.clip(x, -self.clip, self.clip, out=x)
        x = np.ascontiguousarray(x.transpose(0, 2, 1))  # (B, W, F)
        return torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(self._stamp_windows[starts]))

    def __getitem__(self, index):
        if isinstance(index, (list, tuple, np.ndarray)):
            return self.get_batch(index)
        x, stamp = self.get_batch([int(index)])
        return x[0], stamp[0]
