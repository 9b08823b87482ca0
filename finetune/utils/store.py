"""`SeriesPanel` (many candle series as one contiguous feature-major block, the form every data path hands the
engine) and the prepared store, its one on-disk form (`StoreWriter`, `open_store`, `verify_store`). Arrays, shapes
and the folder's files: docs/CONTRACTS.md, "File formats: the prepared data store and `SeriesPanel`"."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from finetune.utils.errors import StoreError
from model.fileio import disk_full, sha256_file, write_json

N_STAMP_COLUMNS = 5  # minute, hour, weekday, day of month, month
FORMAT = "kronos-series-store"
FORMAT_VERSION = 2  # 2: sha256 of every array file in the manifest (1 had none: re-prepared when met)
MANIFEST = "manifest.json"
ARRAY_FILES = ("features_t.npy", "stamps.npy", "datetimes.npy", "offsets.npy", "names.json")


@dataclass(frozen=True)
class SeriesPanel:
    """All series of one split as contiguous arrays (shapes: docs/CONTRACTS.md); validated on construction."""

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
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", size - 10) + body + b" " * pad + b"\n"


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
        self._f.close()  # a no-op once closed


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
        self.close()
        with open(self.path, "wb") as out:
            out.write(npy_header(np.float32, (self.n_features, self.rows)))
            for part in self._parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
                os.remove(part)
        return self.path

    def close(self) -> None:
        for f in self._files:
            f.close()  # a no-op once closed


# The prepared store: one writer, one reader

@contextlib.contextmanager
def _disk_space_named(folder: Path):
    """A disk-full / quota / file-too-large error while writing the store in `folder` -> one StoreError line."""
    try:
        yield
    except OSError as e:
        if not disk_full(e):
            raise
        free = shutil.disk_usage(folder.parent).free if folder.parent.exists() else None
        reason = os.strerror(e.errno or errno.ENOSPC).lower()  # numpy's short write has no errno
        raise StoreError(f"cannot write the data store in {folder.parent}: {reason} "
                         f"({'unknown' if free is None else f'{free / 2**30:.1f} GiB'} free); free some space there, "
                         "or set the store folder (data.store_dir / data.dataset_path) on a larger disk") from None


def snapshot_file(path: str | Path, folder: Path, chunk_bytes: int = 1 << 20) -> tuple[Path, dict]:
    """Copy `path` into the new `folder` (same name) while hashing the bytes copied: (the copy, its
    `file_fingerprint` of exactly the copy's bytes: one read, so a file replaced or edited meanwhile cannot give a
    hash of other bytes than those parsed from the copy)."""
    p, h, size = Path(path), hashlib.sha256(), 0
    folder.mkdir()
    with open(p, "rb") as src, open(folder / p.name, "wb") as dst:
        mtime_ns = os.fstat(src.fileno()).st_mtime_ns
        while chunk := src.read(chunk_bytes):
            h.update(chunk)
            dst.write(chunk)
            size += len(chunk)
    fingerprint = {"path": str(p.resolve()), "bytes": size, "mtime_ns": mtime_ns, "sha256": h.hexdigest()}
    return folder / p.name, fingerprint


class StoreWriter:
    """Write a store into the new folder `path`: `append` series in order, then `finish` (offsets, names, checksums,
    manifest). The arrays grow on disk (a block at a time), so a data set larger than memory can be written."""

    def __init__(self, path: str | Path, n_features: int):
        self.path = Path(path)
        with _disk_space_named(self.path):
            self.path.mkdir(parents=True, exist_ok=False)
        self.features = FeatureMajorWriter(self.path / "features_t.npy", n_features)
        self.stamps = GrowingNpy(self.path / "stamps.npy", np.int64, (N_STAMP_COLUMNS,))
        self.datetimes = GrowingNpy(self.path / "datetimes.npy", np.int64)
        self.names: list[str] = []
        self.lengths: list[int] = []

    def append(self, name: str, features: np.ndarray, stamps: np.ndarray, datetimes: np.ndarray) -> None:
        """One series: features (n, F) time-major, stamps (n, 5), datetimes (n,) int64 ns."""
        with _disk_space_named(self.path):
            self.features.append(features)
            self.stamps.append(stamps)
            self.datetimes.append(datetimes)
        self.names.append(str(name))
        self.lengths.append(len(datetimes))

    def finish(self, features: list[str], **extra) -> dict:
        """Close the arrays and write offsets.npy, names.json and manifest.json (with `extra` keys); the manifest."""
        with _disk_space_named(self.path):
            for w in (self.features, self.stamps, self.datetimes):
                w.finish()
            np.save(self.path / "offsets.npy", np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)]))
            (self.path / "names.json").write_text(json.dumps(self.names), encoding="utf-8")
            manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "n_rows": int(sum(self.lengths)),
                        "n_series": len(self.names), "features": list(features),
                        "checksums": {f: sha256_file(self.path / f) for f in ARRAY_FILES}, **extra}
            write_json(self.path / MANIFEST, manifest)  # atomically: a folder with a manifest is a complete store
        return manifest

    def close(self) -> None:
        for w in (self.features, self.stamps, self.datetimes):
            w.close()


def write_panel(path: str | Path, panel: SeriesPanel, features: list[str], **extra) -> dict:
    """Write a whole in-memory panel (with datetimes) as a store in the new folder `path`; its manifest."""
    if panel.datetimes is None:
        raise ValueError("a store needs the bar datetimes (SeriesPanel.datetimes)")
    writer = StoreWriter(path, panel.n_features)
    try:
        for s in range(panel.n_series):
            rows = panel.rows(s)
            writer.append(panel.names[s], np.asarray(panel.features[:, rows]).T, panel.stamps[rows],
                          panel.datetimes[rows])
        return writer.finish(features, **extra)
    finally:
        writer.close()


def read_manifest(store_dir: str | Path) -> dict:
    """The store's manifest; StoreError when there is none, it is unreadable or of another format version."""
    path = Path(store_dir) / MANIFEST
    if not path.is_file():
        raise StoreError(f"{store_dir} is not a prepared data store (no {MANIFEST}); prepare it first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StoreError(f"{path} cannot be read ({e}); delete the store folder to prepare it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise StoreError(f"{store_dir} holds store format {version!r}, this code reads {FORMAT_VERSION}; delete it "
                         "to prepare it again")
    return manifest


def verify_store(store_dir: str | Path, manifest: dict) -> None:
    """Raise StoreError naming the first array file whose sha256 differs from the manifest's (or that is missing)."""
    store_dir = Path(store_dir)
    for name, digest in manifest["checksums"].items():
        path = store_dir / name
        if not path.is_file() or sha256_file(path) != digest:
            raise StoreError(f"{path} is damaged (its sha256 differs from the one recorded in {MANIFEST} when the "
                             "store was written); delete the store folder to prepare it again")


def open_store(store_dir: str | Path, verify: bool = False) -> SeriesPanel:
    """The store as a SeriesPanel whose features/stamps/datetimes are read-only `np.memmap`s (no copy: every
    process on a machine shares the page cache's one copy). `verify` first checks every array's sha256 (about
    1 s per GB). A missing, truncated or inconsistent file is a StoreError naming it, never a numpy traceback."""
    store_dir = Path(store_dir)
    manifest = read_manifest(store_dir)
    if verify:
        verify_store(store_dir, manifest)
    n, s, f = manifest["n_rows"], manifest["n_series"], len(manifest["features"])
    arrays = {}
    for name in ARRAY_FILES[:4]:
        try:
            arrays[name] = np.load(store_dir / name, mmap_mode=None if name == "offsets.npy" else "r")
        except (OSError, ValueError, EOFError) as e:
            raise StoreError(f"{store_dir / name} cannot be read ({e}); delete the store folder to prepare it "
                             "again") from None
    try:
        names = json.loads((store_dir / "names.json").read_text(encoding="utf-8"))
        if arrays["features_t.npy"].shape != (f, n) or len(names) != s:
            raise ValueError(f"features {arrays['features_t.npy'].shape}, {len(names)} names for {s} series")
        return SeriesPanel(arrays["features_t.npy"], arrays["stamps.npy"], arrays["offsets.npy"], names,
                           arrays["datetimes.npy"])
    except (OSError, ValueError) as e:
        raise StoreError(f"{store_dir}: the arrays do not match the manifest ({e}); delete the folder to prepare it "
                         "again") from None
