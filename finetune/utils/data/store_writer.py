"""Append-only writers for the prepared store's .npy files, whose final length is known only at the end.

The store's arrays are plain uncompressed .npy files (memory-mappable with `np.load(mmap_mode="r")`):

    features_t.npy  float32 (F, N)  feature-major panel
    stamps.npy      int64   (N, 5)  minute, hour, weekday, day, month
    datetimes.npy   int64   (N,)    naive wall-clock ns

Rows arrive series by series, so N grows while writing. A row-major array (stamps, datetimes) is appended behind a
fixed-size header that is rewritten with the final shape at the end (no copy). The feature-major panel cannot grow
in place (each feature row must be contiguous), so each feature is appended to its own scratch file and the F files
are concatenated behind the header at the end: one sequential copy of 4 * F * N bytes.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np

__all__ = ["FeatureMajorWriter", "GrowingNpy", "npy_header"]

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
