"""The CSV pipeline's training data: the prepared, memory-mapped store, its time splits and its run_info summary.

`prepare_data`: rank 0 prepares (or reuses) the data store (finetune/utils/data/data_store.py: streaming CSV/Parquet
parse, the candle checks of finetune/utils/data/candle_checks.py, a manifest with the files' sha256), the other ranks
wait at a barrier, every rank opens it memory-mapped; the splits are index ranges on that panel (`split_panel`, no
copies) that the shared WindowDataset reads (finetune_csv/dataset.py). `data_summary_from_store` reads the
manifest. This is the one production path to the data: training, the held-out evaluation (finetune_csv/forecast.py),
the validation CRPS (finetune_csv/val_metric.py) and the future forecast all read it; the tests compare it with an
independent pandas reference (tests/csv_reference.py) bit for bit.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from finetune.utils.data.data_store import StoreInfo, StoreSettings, ensure_store
from finetune.utils.data.panel import SeriesPanel
from finetune.utils.data.panel_split import PanelSegments, split_panel
from finetune_csv.config import DataConfig
from finetune_csv.data import too_short_problems


@dataclass(frozen=True)
class PreparedData:
    """The data of a run: the store on disk, its memory-mapped panel and the time splits as index ranges."""

    store: StoreInfo
    """The store folder, its manifest and whether it was reused (and why)."""
    panel: SeriesPanel
    """All series, features float32 (6, N) and stamps int64 (N, 5) as read-only np.memmap (shared page cache)."""
    splits: dict[str, PanelSegments]
    """train / val (/ test when data.test_ratio > 0): per-series column ranges of `panel`."""


def prepare_data(cfg: DataConfig, store_dir: str | Path, dist=None, barrier=None, *,
                 with_splits: bool = True) -> PreparedData:
    """Prepare (rank 0) or reuse the data store at `store_dir`, open it memory-mapped and cut the splits.

    Parameters
    ----------
    cfg: the `data:` section.
    store_dir: the store folder (`data.store_dir`, default `<paths.base_dir>/data_store`).
    dist: a DistInfo-like object (`is_main`); None = one process.
    barrier: called by every process once the main one has prepared the store (None = no waiting).
    with_splits: cut (and check the length of) the train / val / test splits; False = the whole series only
        (the future forecast, which needs `lookback` rows per series, not a usable split), `splits` is then {}.

    Returns PreparedData. Raises ValueError (StoreError / ConfigError) naming file, column, line and setting; a
    failed preparation leaves no store and no folder it created.
    """
    store_dir = Path(store_dir)
    is_main = dist is None or dist.is_main
    created = [p for p in [store_dir, *store_dir.parents] if not p.exists()]

    def undo() -> None:
        """Remove what this call created (a fresh store, then the folders it made), so a failed run leaves nothing."""
        if is_main and created:
            shutil.rmtree(store_dir, ignore_errors=True)
            for p in created[1:]:  # innermost first; only folders this call made and that are empty now
                if p.is_dir() and not any(p.iterdir()):
                    p.rmdir()

    try:
        info = ensure_store(cfg.path, store_dir, StoreSettings.from_data_config(cfg), dist=dist, barrier=barrier)
    except Exception:
        undo()
        raise
    panel = info.open()
    if not with_splits:
        return PreparedData(info, panel, {})
    problems = too_short_problems([(name, int(n)) for name, n in zip(panel.names, panel.lengths())], cfg)
    if problems:
        del panel
        undo()
        problems.raise_if_any()
    splits = split_panel(panel, cfg.train_ratio, cfg.val_ratio, cfg.test_ratio, cfg.lookback, cfg.predict)
    return PreparedData(info, panel, splits)


def data_summary_from_store(data: PreparedData, cfg: DataConfig) -> dict:
    """What run_info.json records about the data, from the store's manifest: files with sha256, series, and rows,
    windows and date ranges per split (same keys as the pandas reference's `data_summary`), plus the store folder.
    The same data gives the same summary whether the store was prepared or reused (a resume compares them)."""
    manifest = data.store.manifest
    window = cfg.lookback + cfg.predict
    when = data.panel.datetimes
    per_split = {}
    for name, seg in data.splits.items():
        n = seg.stop - seg.start
        windows = np.where(n >= window, (n - window) // cfg.stride + 1, 0)
        per_split[name] = {
            "rows": int((seg.stop - seg.first_target).sum()),
            "context_rows": int((seg.first_target - seg.start).sum()),
            "windows": int(windows.sum()),
            "start": str(pd.Timestamp(int(np.min(when[seg.first_target])))),
            "end": str(pd.Timestamp(int(np.max(when[seg.stop - 1])))),
        }
    return {
        "files": [{"path": f["path"], "bytes": f["bytes"], "sha256": f["sha256"]} for f in manifest["sources"]],
        "series": [{"name": s["name"], "rows": s["rows"], "start": s["start"], "end": s["end"]}
                   for s in manifest["series"]],
        "splits": per_split,
        # Only what identifies the data: whether this run prepared or reused the store is no property of the data,
        # and recording it would make a resumed run's data fingerprint differ (finetune/utils/safety/resume.py).
        "store": {"path": str(data.store.path)},
    }
