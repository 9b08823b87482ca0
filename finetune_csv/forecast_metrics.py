"""Consistency of generated candles (reported in metrics.json); the forecast scores live in finetune.evaluation."""

from __future__ import annotations

import numpy as np


def candle_violations(open_: np.ndarray, high: np.ndarray, low: np.ndarray, close: np.ndarray,
                      volume: np.ndarray) -> dict[str, float]:
    """Share of generated candles breaking each consistency rule, and breaking any of them.

    Rules: high >= max(open, close); low <= min(open, close); volume >= 0. The tokenizer decodes each feature
    independently, so nothing forces a generated candle to respect them; this measures how often it does not.
    """
    o, h, l, c, v = (np.asarray(a, dtype=np.float64).ravel() for a in (open_, high, low, close, volume))
    if not (len(o) == len(h) == len(l) == len(c) == len(v)) or len(o) == 0:
        raise ValueError("candle_violations needs equally long, non-empty open/high/low/close/volume")
    bad_high = h < np.maximum(o, c)
    bad_low = l > np.minimum(o, c)
    bad_volume = v < 0
    return {
        "high_below_body": float(bad_high.mean()),
        "low_above_body": float(bad_low.mean()),
        "negative_volume": float(bad_volume.mean()),
        "any": float((bad_high | bad_low | bad_volume).mean()),
    }
