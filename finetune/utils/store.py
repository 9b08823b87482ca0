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

Also here:
- Append-only writers for the prepared store's .npy files, whose final length is known only at the end.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

N_STAMP_COLUMNS = 5  # minute, hour, weekday, day of month, month



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


_HEADER_BYTES = 128  # fixed header size: a multiple of 64 (numpy's alignment) with room for any 2-D shape


def npy_header(dtype: np.dtype, shape: tuple[int, ...], size: int = _HEADER_BYTES) -> bytes:
    """An .npy version-1.0 header of exactly `size` bytes for a C-ordered array (padded with spaces, like numpy)."""
    body = repr({"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                 "shape": tuple(int(s) for s in shape)}).encode("latin1")
    pad = size - 10 - len(body) - 1
    if pad < 0:
        raise ValueError(f"shape {shape} does not fit an .npy header of {size} bytes")
    out = b"\x93NUMPY\x01\x00" + struct.pack("<H", size - 10) + body + b" " * pad + b"\n"
    return out


class GrowingNpy:
    """A row-major .npy file of rows of shape `row_shape` and `dtype`, appended to, finished with its final shape."""

    def __init__(self, path: Path, dtype: np.dtype, row_shape: tuple[int, ...] = ()):
        self.path, self.dtype, self.row_shape = Path(path), np.dtype(dtype), tuple(row_shape)
        self.rows = 0
        self._f = open(self.path, "wb")  # noqa: SIM115  (open until finish())
        self._f.write(b"\0" * _HEADER_BYTES)  # placeholder, rewritten by finish()

    def append(self, rows: np.ndarray) -> None:
        """Append rows (n, *row_shape) (converted to the file's dtype, C order)."""
        arr = np.ascontiguousarray(rows, dtype=self.dtype)
        if arr.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path.name}: rows of shape {self.row_shape} expected, got {arr.shape[1:]}")
        arr.tofile(self._f)
        self.rows += arr.shape[0]

    def finish(self) -> Path:
        """Write the header with the final shape and close."""
        self._f.seek(0)
        self._f.write(npy_header(self.dtype, (self.rows,) + self.row_shape))
        self._f.close()
        return self.path

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class FeatureMajorWriter:
    """`features_t.npy` (F, N) float32 built from time-major appends of (n, F) blocks."""

    def __init__(self, path: Path, n_features: int):
        self.path = Path(path)
        self.n_features = int(n_features)
        self.rows = 0
        self._parts = [self.path.with_name(f".{self.path.stem}.{i}.part") for i in range(self.n_features)]
        self._files = [open(p, "wb") for p in self._parts]  # noqa: SIM115  (open until finish())

    def append(self, values: np.ndarray) -> None:
        """Append a block (n, F) (any float dtype; stored as float32)."""
        if values.ndim != 2 or values.shape[1] != self.n_features:
            raise ValueError(f"features must be (n, {self.n_features}), got {values.shape}")
        block = np.asarray(values, dtype=np.float32)  # same rounding as SeriesPanel.from_series
        for f, out in zip(range(self.n_features), self._files):
            np.ascontiguousarray(block[:, f]).tofile(out)
        self.rows += values.shape[0]

    def finish(self) -> Path:
        """Concatenate the per-feature parts behind the header into features_t.npy; remove the parts."""
        for f in self._files:
            f.close()
        with open(self.path, "wb") as out:
            out.write(npy_header(np.float32, (self.n_features, self.rows)))
            for part in self._parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
                os.remove(part)
        return self.path

    def close(self) -> None:
        for f in self._files:
            if not f.closed:
                f.close()
