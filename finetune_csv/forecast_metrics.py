"""Scores of a forecast against the held-out candles: pure functions on arrays, no model, no files."""

from __future__ import annotations

import numpy as np


def close_mae(pred_close: np.ndarray, true_close: np.ndarray) -> float:
    """Mean absolute error of the close, over every window and step; inputs (N, H) or (H,) in price units."""
    pred, true = np.asarray(pred_close, dtype=np.float64), np.asarray(true_close, dtype=np.float64)
    if pred.shape != true.shape:
        raise ValueError(f"forecast and actual closes differ in shape: {pred.shape} vs {true.shape}")
    return float(np.mean(np.abs(pred - true)))


def persistence_close(last_close: np.ndarray, horizon: int) -> np.ndarray:
    """The naive baseline: the last context close repeated over the horizon; (N,) -> (N, horizon)."""
    return np.repeat(np.asarray(last_close, dtype=np.float64)[:, None], horizon, axis=1)


def direction_accuracy(pred_close: np.ndarray, true_close: np.ndarray, last_close: np.ndarray) -> float:
    """Share of steps where the forecast moves the same way as the actual close.

    The move at step h is close[h] - close[h-1], with close[-1] the last context close (known to both). Signs
    are compared with np.sign, so a flat step only matches a flat step. Inputs: (N, H), (N, H), (N,).
    """
    pred, true = np.atleast_2d(pred_close).astype(np.float64), np.atleast_2d(true_close).astype(np.float64)
    last = np.asarray(last_close, dtype=np.float64).reshape(-1, 1)  # (N, 1)
    if pred.shape != true.shape or last.shape[0] != pred.shape[0]:
        raise ValueError(f"shapes do not line up: forecast {pred.shape}, actual {true.shape}, last {last.shape}")
    pred_moves = np.diff(np.concatenate([last, pred], axis=1), axis=1)  # (N, H)
    true_moves = np.diff(np.concatenate([last, true], axis=1), axis=1)
    return float(np.mean(np.sign(pred_moves) == np.sign(true_moves)))


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
