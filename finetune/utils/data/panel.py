"""`SeriesPanel`: many candle series stored as one contiguous block, the form every data path hands the engine.

    features   float32 (F, N)   feature-major: row f holds feature f of every bar of every series, series after
                                series, each in time order (F = 6: open, high, low, close, volume, amount)
    stamps     int64   (N, 5)   minute, hour, weekday (Monday=0), day of month, month of each bar
    offsets    int64   (S + 1,) the bars of series s are columns offsets[s]:offsets[s + 1]; offsets[0] = 0,
                                offsets[-1] = N
    names      str     (S,)     series names (symbol, file name) for messages
    datetimes  int64   (N,)     optional: bar time as nanoseconds since 1970-01-01 (naive wall-clock time)

Feature-major storage makes a window's statistics reductions over a contiguous time axis; the arrays may be
`np.memmap`s (a prepared data store opened read-only on every rank), and nothing here copies them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

N_STAMP_COLUMNS = 5  # minute, hour, weekday, day of month, month

__all__ = ["SeriesPanel", "N_STAMP_COLUMNS"]


@dataclass(frozen=True)
class SeriesPanel:
    """All series of one split as contiguous arrays (shapes in the module docstring); validated on construction."""

    features: np.ndarray
    stamps: np.ndarray
    offsets: np.ndarray
    names: Sequence[str]
    datetimes: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.features.ndim != 2:
            raise ValueError(f"features must be feature-major (F, N), got shape {self.features.shape}")
        n = self.features.shape[1]
        if self.stamps.shape != (n, N_STAMP_COLUMNS):
            raise ValueError(f"stamps must be ({n}, {N_STAMP_COLUMNS}), got {self.stamps.shape}")
        if self.datetimes is not None and self.datetimes.shape != (n,):
            raise ValueError(f"datetimes must be ({n},), got {self.datetimes.shape}")
        offsets = np.asarray(self.offsets)
        if offsets.shape != (len(self.names) + 1,) or offsets[0] != 0 or offsets[-1] != n:
            raise ValueError(f"offsets must run from 0 to {n} with one entry per series plus one "
                             f"(got {offsets.shape[0]} entries for {len(self.names)} series)")
        if np.any(np.diff(offsets) < 0):
            raise ValueError("offsets must be non-decreasing")

    @classmethod
    def from_series(cls, features: Sequence[np.ndarray], stamps: Sequence[np.ndarray], names: Sequence[str],
                    datetimes: Sequence[np.ndarray] | None = None) -> SeriesPanel:
        """Concatenate per-series arrays (features (N_s, F) time-major, stamps (N_s, 5)) into one panel (one copy)."""
        if not len(features):
            raise ValueError("a panel needs at least one series")
        lengths = np.array([len(f) for f in features], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        feats = np.ascontiguousarray(np.concatenate(features).T, dtype=np.float32)  # (F, N)
        stamp = np.ascontiguousarray(np.concatenate(stamps), dtype=np.int64)  # (N, 5)
        when = None if datetimes is None else np.ascontiguousarray(np.concatenate(datetimes), dtype=np.int64)
        return cls(feats, stamp, offsets, list(names), when)

    @property
    def n_series(self) -> int:
        return len(self.names)

    @property
    def n_rows(self) -> int:
        return int(self.features.shape[1])

    @property
    def n_features(self) -> int:
        return int(self.features.shape[0])

    def lengths(self) -> np.ndarray:
        """Bars per series, int64 (S,)."""
        return np.diff(np.asarray(self.offsets))

    def rows(self, s: int) -> slice:
        """Column slice of series `s`."""
        return slice(int(self.offsets[s]), int(self.offsets[s + 1]))
