"""Thin adapter: the CSV splits (finetune_csv.data) -> the shared sliding-window dataset (finetune.utils)."""

from __future__ import annotations

import numpy as np

from finetune.utils.window_dataset import SeriesArrays, WindowDataset
from finetune_csv.config import DataConfig
from finetune_csv.data import Segment
from model.features import calc_time_stamps


def segment_arrays(segment: Segment) -> SeriesArrays:
    """One segment as the window dataset's arrays: features float32 (n, 6), calendar stamps int64 (n, 5)."""
    stamps = calc_time_stamps(segment.timestamps).to_numpy(dtype=np.int64)  # (n, 5) minute, hour, weekday, day, month
    return SeriesArrays(features=segment.values.astype(np.float32), stamps=stamps, name=segment.series.name)


def build_dataset(segments: list[Segment], cfg: DataConfig) -> WindowDataset:
    """All windows of `lookback + predict` rows, `stride` apart, inside each segment (never across series).

    Val/test segments start `lookback` rows before their split (see `split_series`), so every window of a
    segment predicts rows of its own split. Normalisation uses each window's lookback rows only (in the dataset).
    """
    return WindowDataset([segment_arrays(s) for s in segments], cfg.lookback, cfg.predict,
                         stride=cfg.stride, clip=cfg.clip)
