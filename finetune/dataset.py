"""The preprocessed Qlib splits on disk, and the training datasets built from them.

`qlib_data_preprocess.py` writes, in `data.dataset_path`, one prepared data store per split (the layout of
finetune/utils/store.py, so every rank memory-maps it with `open_store` and shares one page-cache copy):

    train/, val/, test/          each a store; its names.json holds S instrument codes (one code may own several
                                 series: the pieces of its history cut at data gaps or between membership spells)
    manifest.json                settings the splits were made with, date ranges, counts, dropped instruments, the
                                 market calendar (ns) of the load range, and `content_sha256`: the splits' identity
                                 (a hash of their arrays' sha256s), so the folder may move between folders and
                                 machines; the Qlib source path it was read from is recorded, never compared

`load_split` returns a split as a `SeriesPanel` of read-only memory maps and `save_split` writes one. Training hands
the panel to the shared `WindowDataset` as it is (windows never cross two series; normalised with lookback-only
statistics); which windows an epoch uses, on which rank, is the engine's `EpochSampler`'s business."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from finetune.config import QlibConfig
from finetune.qlib_io import date_range
from finetune.utils.config_utils import Problems
from finetune.utils.fingerprint import digest, tree_sha256
from finetune.utils.store import SeriesPanel, StoreError, open_store, write_panel
from finetune.utils.windows import WindowDataset
from model.errors import DataError
from model.features import FEATURES
from model.fileio import read_json_object

log = logging.getLogger("finetune.qlib")

SPLITS = ("train", "val", "test")
MANIFEST_NAME = "manifest.json"
# v3: one memory-mappable store per split (v2: .npz), series cut at gaps and membership spells, calendar_ns;
# v4: content_sha256 identifies the splits (the source path is no longer compared)
FORMAT = "kronos-qlib-splits/v4"


def split_path(dataset_path: str | Path, split: str) -> Path:
    """The store folder of one split."""
    return Path(dataset_path).expanduser() / split


def save_split(path: str | Path, split: SeriesPanel) -> Path:
    """Write one split (a panel with datetimes) as a prepared data store (finetune/utils/store.py, the writer the
    CSV pipeline uses too). `path` must not exist yet (the caller writes into a fresh folder)."""
    write_panel(path, split, list(FEATURES), source="qlib_data_preprocess.py")
    return Path(path)


def load_split(path: str | Path) -> SeriesPanel:
    """Open a split written by `save_split` as a SeriesPanel of read-only memory maps (no copy)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} not found: run `python finetune/qlib_data_preprocess.py --config ...` "
                                "first (data.dataset_path)")
    try:
        panel = open_store(path, verify=True)  # a damaged split is named, never trained on
    except (StoreError, OSError, KeyError) as e:
        raise DataError(f"{path}: not a readable split ({e}); rerun the preprocessing") from None
    if panel.n_features != len(FEATURES):
        raise DataError(f"{path}: features must be ({len(FEATURES)}, N), got {panel.features.shape}; rerun the "
                        "preprocessing")
    return panel


def content_sha256(dataset_path: str | Path) -> str:
    """The identity of the splits in `dataset_path`: sha256 of every split's array sha256s (its store manifest's
    `checksums`, which `load_split` verifies against the arrays). Same content, same hash, wherever it lies."""
    sums = {s: read_manifest(split_path(dataset_path, s)).get("checksums") for s in SPLITS
            if (split_path(dataset_path, s) / MANIFEST_NAME).is_file()}
    return digest(sums)


def read_manifest(dataset_path: str | Path) -> dict[str, Any]:
    return read_json_object(Path(dataset_path).expanduser() / MANIFEST_NAME, "a splits manifest")


def manifest_settings(cfg: QlibConfig) -> dict[str, Any]:
    """The settings recorded in manifest.json that the splits depend on (compared by `check_processed`): changing
    any of them after preprocessing means preprocessing again."""
    d = cfg.data
    source = Path(os.path.expanduser(d.qlib_data_path)).resolve()
    # The source's content at this frequency (calendar, universes, feature files): rebuilt in place, it is noticed
    # (None once it is gone: the splits alone are then what the trainers read).
    qlib_files = lambda name: name.startswith(("calendars/", "instruments/")) or (  # noqa: E731
        name.startswith("features/") and name.endswith(f".{d.freq}.bin"))
    content = tree_sha256(source, qlib_files) if source.is_dir() else None
    return {"qlib_data_path": str(source), "qlib_data_content": content,
            **{k: getattr(d, k) for k in ("instrument", "freq", "lookback", "predict", "amount_source")},
            **{k: list(getattr(d, k)) for k in ("train_time_range", "val_time_range", "test_time_range")},
            "max_gap_days": d.max_gap_days, "features": list(FEATURES)}


def check_processed(cfg: QlibConfig, splits: tuple[str, ...], problems: Problems) -> None:
    """Record a problem (naming data.dataset_path or the changed setting) unless the splits exist and were made
    with the current settings (a different lookback, range or universe would silently mix two setups)."""
    folder = Path(cfg.data.dataset_path).expanduser()
    fix = "run `python finetune/qlib_data_preprocess.py` with this config first"
    missing = [MANIFEST_NAME] if not (folder / MANIFEST_NAME).is_file() else [
        f"{s}/" for s in splits if not (split_path(folder, s) / MANIFEST_NAME).is_file()]
    if missing:
        problems.add("data.dataset_path", f"{folder} lacks {', '.join(missing)}; {fix}")
        return
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as e:
        problems.add("data.dataset_path", f"{folder / MANIFEST_NAME} is unreadable ({e}); {fix}")
        return
    if manifest.get("format") != FORMAT:
        problems.add("data.dataset_path", f"{folder} holds splits of format {manifest.get('format')!r}, not "
                     f"{FORMAT!r}; {fix}")
        return
    if manifest.get("content_sha256") != content_sha256(folder):
        problems.add("data.dataset_path", f"the splits in {folder} are not the ones its {MANIFEST_NAME} was written "
                     f"with (their content hash differs: a split replaced or copied in from elsewhere?); {fix}")
        return
    made_with = manifest.get("settings", {})
    for key, now in manifest_settings(cfg).items():
        if key == "qlib_data_content" and None not in (made_with.get(key), now) and made_with[key] != now:
            problems.add("data.qlib_data_path", f"its content changed since the splits in {folder} were made from it "
                         f"(sha256 {made_with[key][:12]} -> {now[:12]}: the store was rebuilt or edited); {fix}")
        elif key not in ("qlib_data_path", "qlib_data_content") and key in made_with and made_with[key] != now:
            problems.add(f"data.{key}", f"is {now!r} but the splits in {folder} were made with {made_with[key]!r}; "
                         f"{fix}")


def build_window_dataset(split: SeriesPanel, cfg: QlibConfig, name: str) -> WindowDataset:
    """Every window of lookback + predict bars inside each instrument of `split`, as the shared WindowDataset.
    Instruments too short for one window are logged (never dropped silently); no window at all is a DataError."""
    d = cfg.data
    if split.n_series == 0:
        raise DataError(f"data.{name}_time_range: the {name} split holds no instrument; widen the range and "
                        "preprocess again")
    try:
        ds = WindowDataset(split, d.window)
    except ValueError as e:
        raise DataError(f"data.{name}_time_range: the {name} split has no window ({e})") from None
    if ds.short_series:
        shown = ", ".join(f"{n} ({rows} bars)" for n, rows in ds.short_series[:10])
        more = f" and {len(ds.short_series) - 10} more" if len(ds.short_series) > 10 else ""
        log.info("[%s] %d instrument(s) shorter than one window of %d bars give no window: %s%s",
                 name, len(ds.short_series), d.window.size, shown, more)
    log.info("[%s] %d instruments, %d bars, %d windows", name, split.n_series, split.n_rows, len(ds))
    return ds


def build_train_val_datasets(cfg: QlibConfig) -> tuple[WindowDataset, WindowDataset, dict[str, Any]]:
    """(train_set, val_set, data_info for run_info.json) from the files in data.dataset_path."""
    folder = Path(cfg.data.dataset_path).expanduser()
    manifest = read_manifest(folder)
    settings = {k: v for k, v in manifest.get("settings", {}).items() if k != "qlib_data_path"}
    # What defines the data (its fingerprint guards a resume): the content, never where it lies.
    sets, info = {}, {"content_sha256": manifest.get("content_sha256"), "settings": settings, "splits": {}}
    for name in ("train", "val"):
        split = load_split(split_path(folder, name))
        sets[name] = build_window_dataset(split, cfg, name)
        dates = date_range(split)
        info["splits"][name] = {"instruments": split.n_series, "rows": split.n_rows, "windows": len(sets[name]),
                                "start": dates[0] if dates else None, "end": dates[1] if dates else None}
    return sets["train"], sets["val"], info
