"""Thin adapter: a split of the prepared store -> the shared sliding-window dataset
(finetune.utils.data.window_dataset).

Training reads a split of the memory-mapped store (`PanelSegments`, finetune_csv.prepared.prepare_data): the shared
`WindowDataset` on the mapped panel inside the split's column ranges, nothing copied.
"""

from __future__ import annotations

from finetune.utils.data.panel_split import PanelSegments
from finetune.utils.data.window_dataset import WindowDataset
from finetune_csv.config import DataConfig


def build_dataset(segments: PanelSegments, cfg: DataConfig) -> WindowDataset:
    """All windows of `lookback + predict` rows, `stride` apart, inside each series' range (never across series).

    Val/test ranges start `lookback` rows before their split (see `split_panel`), so every window of a split predicts
    rows of its own split. Normalisation uses each window's lookback rows only.
    """
    return segments.dataset(cfg.lookback, cfg.predict, stride=cfg.stride, clip=cfg.clip)
