"""Thin adapter: the CSV splits -> the shared sliding-window dataset (finetune.utils.window_dataset).

Training reads a split of the memory-mapped store (`PanelSegments`, finetune_csv.prepared.prepare_data): the shared
`WindowDataset` on the mapped panel inside the split's column ranges, nothing copied. A list of in-memory
`Segment`s (the pandas reference path, finetune_csv.data.split_series) gives the same windows bit for bit; it is
what the tests compare with.
"""

from __future__ import annotations

import numpy as np

from finetune.utils.panel_split import PanelSegments
from finetune.utils.window_dataset import SeriesArrays, WindowDataset
from finetune_csv.config import DataConfig
from finetune_csv.data import Segment
from model.features import calc_time_stamps


def segment_arrays(segment: Segment) -> SeriesArrays:
    """One segment as the window dataset's arrays: features float32 (n, 6), calendar stamps int64 (n, 5)."""
    stamps = calc_time_stamps(segment.timestamps).to_numpy(dtype=np.int64)  # (n, 5) minute, hour, weekday, day, month
    return SeriesArrays(features=segment.values.astype(np.float32), stamps=stamps, name=segment.series.name)


def build_dataset(segments: PanelSegments | list[Segment], cfg: DataConfig) -> WindowDataset:
    """All windows of `lookback + predict` rows, `stride` apart, inside each segment (never across series).

    Val/test segments start `lookback` rows before their split (see `split_series` / `split_panel`), so every
    window of a segment predicts rows of its own split. Normalisation uses each window's lookback rows only.
    """
    if isinstance(segments, PanelSegments):
        return segments.dataset(cfg.lookback, cfg.predict, stride=cfg.stride, clip=cfg.clip)
    return WindowDataset([segment_arrays(s) for s in segments], cfg.lookback, cfg.predict,
                         stride=cfg.stride, clip=cfg.clip)
