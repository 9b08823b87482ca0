"""The preprocessed Qlib splits on disk, and the training datasets built from them.

`qlib_data_preprocess.py` writes, in `data.dataset_path`:

    train.npz, val.npz, test.npz   read with np.load(allow_pickle=False): loading runs no code (unlike pickle)
        features     float32 (N, 6)   open, high, low, close, volume, amount (model.features.FEATURE_COLS); one
                                      instrument's rows contiguous, in time order
        stamps       int64   (N, 5)   minute, hour, weekday (Mon=0), day of month, month
        datetimes    int64   (N,)     bar time as nanoseconds since 1970-01-01 (naive, as Qlib stores it)
        offsets      int64   (S + 1,) rows of instrument s are offsets[s]:offsets[s + 1]
        instruments  str     (S,)     instrument codes
    manifest.json                     settings the splits were made with, date ranges, counts, dropped instruments

`load_split` returns a split as a `SeriesPanel` (finetune/utils/panel.py; features transposed to feature-major
(6, N), names = instrument codes, datetimes set) and `save_split` writes one. Training hands the panel to the
shared `WindowDataset` as it is (windows never cross two instruments; normalised with
lookback-only statistics); which windows an epoch uses, on which rank, is the engine's `EpochSampler`'s business.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from finetune.config import QlibConfig
from finetune.qlib_io import date_range
from finetune.utils.config_utils import Problems
from finetune.utils.panel import SeriesPanel
from finetune.utils.window_dataset import WindowDataset
from model.features import FEATURE_COLS

__all__ = [
    "SPLITS",
    "MANIFEST_NAME",
    "FORMAT",
    "split_path",
    "save_split",
    "load_split",
    "read_manifest",
    "check_processed",
    "build_window_dataset",
    "build_train_val_datasets",
]

log = logging.getLogger("finetune.qlib")

SPLITS = ("train", "val", "test")
MANIFEST_NAME = "manifest.json"
FORMAT = "kronos-qlib-splits/v2"  # v2: manifest keys lookback / predict / features (v1: *_window / feature_list)
_ARRAYS = ("features", "stamps", "datetimes", "offsets", "instruments")
# Settings a split depends on: changing any of them after preprocessing means preprocessing again.
_MANIFEST_KEYS = ("qlib_data_path", "instrument", "freq", "lookback", "predict", "amount_source",
                  "train_time_range", "val_time_range", "test_time_range", "features")


def split_path(dataset_path: str | Path, split: str) -> Path:
    return Path(dataset_path).expanduser() / f"{split}.npz"


def save_split(path: str | Path, split: SeriesPanel) -> Path:
    """Write one split (a panel with datetimes) as an uncompressed .npz of plain arrays: features time-major
    (N, 6) as stored since v1, instrument names as a fixed-width str array."""
    path = Path(path)
    if split.datetimes is None:
        raise ValueError("a Qlib split needs the bar datetimes (SeriesPanel.datetimes)")
    names = np.asarray([str(s) for s in split.names], dtype=str) if split.n_series else np.zeros(0, dtype="<U1")
    with open(path, "wb") as f:  # a file object: np.savez would otherwise append ".npz" to the name
        np.savez(
            f,
            features=np.ascontiguousarray(np.asarray(split.features, dtype=np.float32).T),  # (N, 6)
            stamps=np.ascontiguousarray(split.stamps, dtype=np.int64),
            datetimes=np.ascontiguousarray(split.datetimes, dtype=np.int64),
            offsets=np.ascontiguousarray(split.offsets, dtype=np.int64),
            instruments=names,
        )
    return path


def load_split(path: str | Path) -> SeriesPanel:
    """Read a split written by `save_split` as a SeriesPanel (features transposed to (6, N) once);
    allow_pickle=False, so a tampered file cannot run code."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `python finetune/qlib_data_preprocess.py --config ...` first (data.dataset_path)")
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in _ARRAYS if k not in z.files]
        if missing:
            raise ValueError(f"{path} lacks arrays {missing}; it was not written by qlib_data_preprocess.py, rerun it")
        features = z["features"]
        if features.ndim != 2 or features.shape[1] != len(FEATURE_COLS):
            raise ValueError(f"{path}: features must be (N, {len(FEATURE_COLS)}), got {features.shape}; rerun the preprocessing")
        try:
            return SeriesPanel(
                features=np.ascontiguousarray(features.T, dtype=np.float32),  # (6, N) feature-major
                stamps=z["stamps"].astype(np.int64, copy=False),
                offsets=z["offsets"].astype(np.int64, copy=False),
                names=z["instruments"],
                datetimes=z["datetimes"].astype(np.int64, copy=False),
            )
        except ValueError as e:
            raise ValueError(f"{path}: inconsistent arrays ({e}); rerun the preprocessing") from None


def read_manifest(dataset_path: str | Path) -> dict[str, Any]:
    path = Path(dataset_path).expanduser() / MANIFEST_NAME
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def manifest_settings(cfg: QlibConfig) -> dict[str, Any]:
    """The settings recorded in manifest.json that the splits depend on (compared by `check_processed`)."""
    d = cfg.data
    return {
        "qlib_data_path": str(Path(os.path.expanduser(d.qlib_data_path)).resolve()),
        "instrument": d.instrument,
        "freq": d.freq,
        "lookback": d.lookback,
        "predict": d.predict,
        "amount_source": d.amount_source,
        "train_time_range": list(d.train_time_range),
        "val_time_range": list(d.val_time_range),
        "test_time_range": list(d.test_time_range),
        "features": list(FEATURE_COLS),
    }


def check_processed(cfg: QlibConfig, splits: tuple[str, ...], problems: Problems) -> None:
    """Record a problem (naming data.dataset_path or the changed setting) unless the splits exist and were made
    with the current settings (a different lookback, range or universe would silently mix two setups)."""
    folder = Path(cfg.data.dataset_path).expanduser()
    fix = "run `python finetune/qlib_data_preprocess.py` with this config first"
    missing = [p.name for p in [folder / MANIFEST_NAME, *(split_path(folder, s) for s in splits)] if not p.is_file()]
    if missing:
        problems.add("data.dataset_path", f"{folder} lacks {', '.join(missing)}; {fix}")
        return
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as e:
        problems.add("data.dataset_path", f"{folder / MANIFEST_NAME} is unreadable ({e}); {fix}")
        return
    if manifest.get("format") != FORMAT:
        problems.add("data.dataset_path", f"{folder} holds splits of format {manifest.get('format')!r}, not {FORMAT!r}; {fix}")
        return
    made_with = manifest.get("settings", {})
    for key, now in manifest_settings(cfg).items():
        if key in made_with and made_with[key] != now:
            problems.add(f"data.{key}", f"is {now!r} but the splits in {folder} were made with {made_with[key]!r}; {fix}")


def build_window_dataset(split: SeriesPanel, cfg: QlibConfig, name: str) -> WindowDataset:
    """Every window of lookback + predict bars inside each instrument of `split`, as the shared WindowDataset.

    Instruments too short for one window are listed in the log (never dropped silently); a split with no window
    at all raises ValueError naming the time range to widen.
    """
    d = cfg.data
    if split.n_series == 0:
        raise ValueError(f"data.{name}_time_range: the {name} split holds no instrument; widen the range and preprocess again")
    try:
        ds = WindowDataset(split, d.lookback, d.predict, clip=d.clip)
    except ValueError as e:
        raise ValueError(f"data.{name}_time_range: the {name} split has no window ({e})") from None
    if ds.short_series:
        shown = ", ".join(f"{n} ({rows} bars)" for n, rows in ds.short_series[:10])
        more = f" and {len(ds.short_series) - 10} more" if len(ds.short_series) > 10 else ""
        log.info("[%s] %d instrument(s) shorter than one window of %d bars give no window: %s%s",
                 name, len(ds.short_series), ds.window, shown, more)
    log.info("[%s] %d instruments, %d bars, %d windows", name, split.n_series, split.n_rows, len(ds))
    return ds


def build_train_val_datasets(cfg: QlibConfig) -> tuple[WindowDataset, WindowDataset, dict[str, Any]]:
    """(train_set, val_set, data_info for run_info.json) from the files in data.dataset_path."""
    folder = Path(cfg.data.dataset_path).expanduser()
    sets, info = {}, {"dataset_path": str(folder.resolve()), "splits": {}}
    for name in ("train", "val"):
        split = load_split(split_path(folder, name))
        sets[name] = build_window_dataset(split, cfg, name)
        dates = date_range(split)
        info["splits"][name] = {
            "instruments": split.n_series, "rows": split.n_rows, "windows": len(sets[name]),
            "start": dates[0] if dates else None, "end": dates[1] if dates else None,
        }
    try:
        info["manifest"] = read_manifest(folder)
    except (OSError, ValueError):
        pass
    return sets["train"], sets["val"], info
