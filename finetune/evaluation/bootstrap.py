"""Seeded bootstrap confidence intervals over forecast windows (iid or moving-block).

Windows from one series overlap in time and their errors are correlated; resampling blocks of `block` consecutive
windows keeps that dependence inside each resample (Kuensch 1989). Order the windows by time so that neighbours are
adjacent; with several series, keep each series' windows contiguous.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def resample_indices(n: int, n_boot: int, block: int = 1, seed: int = 0) -> np.ndarray:
    """Bootstrap index sets over `n` windows.

    Parameters
    ----------
    n : number of windows; n_boot : number of resamples; block : block length (1 = iid bootstrap);
    seed : the same seed gives the same resamples.

    Returns
    -------
    (n_boot, n) int64 indices; each row concatenates ceil(n / block) blocks of consecutive windows starting at
    uniformly drawn positions in [0, n - block], cut to n.
    """
    if n < 1:
        raise ValueError("bootstrap needs at least one window")
    if n_boot < 1:
        raise ValueError(f"n_boot={n_boot} must be >= 1")
    block = int(min(max(block, 1), n))
    rng = np.random.default_rng(seed)
    n_blocks = -(-n // block)
    starts = rng.integers(0, n - block + 1, size=(n_boot, n_blocks))  # (n_boot, n_blocks)
    idx = (starts[:, :, None] + np.arange(block)).reshape(n_boot, -1)  # (n_boot, n_blocks * block)
    return idx[:, :n]


def bootstrap_ci(statistic: Callable[[np.ndarray], float], n: int, n_boot: int = 1000, block: int = 1,
                 seed: int = 0, level: float = 0.95) -> dict[str, float]:
    """Percentile confidence interval of `statistic` over resampled windows.

    Parameters
    ----------
    statistic : maps an index array (n,) of windows to one number, e.g. `lambda i: crps[i].mean()`; ratios of sums
        (WQL) and paired differences (model - baseline) are computed inside it on the same indices.
    n : number of windows; n_boot, block, seed : see `resample_indices`; level : coverage of the interval.

    Returns
    -------
    {"estimate": statistic on all windows, "low", "high": percentile bounds, "level", "n_boot", "block"}.
    """
    idx = resample_indices(n, n_boot, block, seed)
    draws = np.array([statistic(row) for row in idx], dtype=np.float64)
    draws = draws[np.isfinite(draws)]
    alpha = (1.0 - level) / 2.0
    low, high = (np.quantile(draws, [alpha, 1.0 - alpha]) if len(draws) else (np.nan, np.nan))
    return {"estimate": float(statistic(np.arange(n))), "low": float(low), "high": float(high),
            "level": level, "n_boot": int(n_boot), "block": int(min(max(block, 1), n))}
