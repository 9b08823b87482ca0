"""Inference on forecast scores: HAC variance, bootstraps, paired differences and the helps / hurts verdict.

One module for the forecast report (`kronos forecast`), the CSV walk-forward (finetuned - zero-shot CRPS per window)
and the Qlib walk-forward (finetuned - zero-shot daily IC).

The verdict (`paired_test`). Paired differences d (one per window, < 0 = the first forecaster better for losses)
are averaged over the windows of one date: correlated series at a date are one observation, not several. The T
date means x_1..x_T, in time order over the pooled test periods, are the sample. Neighbouring dates are dependent
(volatility clusters; with overlapping horizons the differences are MA(h - 1)), so:
- variance: Newey-West (Bartlett) long-run variance with bandwidth L = max(lag, floor(4 (T/100)^(2/9))), `lag` the
  known dependence (h - 1 for h-step overlapping targets, 0 for non-overlapping windows);
- independent blocks: B = floor(T / (L + 1)) runs of L + 1 consecutive dates. The HAC variance is then worth about
  B - 1 degrees of freedom, so the Diebold-Mariano t = mean / se is read against Student t with B - 1 df, not the
  normal: with few dates the normal's 1.96 rejects far too often (heavy tails, an underestimated long-run variance);
- the moving-block bootstrap of the date means (blocks of L + 1 dates) gives a second, distribution-free interval;
- `helps` / `hurts` only when BOTH intervals exclude 0 on the same side; `no_evidence` when either contains 0, when
  they disagree, or when B < MIN_BLOCKS (a 95% interval from fewer independent blocks is not worth its level).
Why not resample (fold, series) blocks, as before: one series with 3 folds is 3 blocks, and the percentile interval
of 3 block means is the range of the fold means; on null data it said helps / hurts 26% of the time (5% nominal).
The simulation in tests/test_statistics.py (null differences with MA(h - 1) dependence, volatility clustering,
t(4) tails and cross-series correlation 0.5) measures this verdict's false helps / hurts rate at 1 series x 3 folds,
1 x 4 and 5 x 4. The interval is about the mean difference over these test dates for these fold models: it does not
treat the folds' models as a sample of finetuning runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd
from scipy import stats as sps

from model.errors import DataError

MIN_BLOCKS = 8
LAGMULT = 3
Z_95, Z_80 = 1.959963984540054, 0.8416212335729143  # two-sided 5% test, 80% power


def hac_variance(x: np.ndarray, lag: int, flat: int = 0) -> float:
    """Long-run variance of `x (T,)` (time order): g_0 + 2 sum_{l<=lag} w_l g_l with g_l = (1/T) sum_t (x_t - m)
    (x_{t-l} - m); w_l = 1 up to `flat`, then Bartlett's taper (flat 0 = Newey-West, w_l = 1 - l / (lag + 1)).
    A flat part over a known MA(flat) dependence removes the Bartlett bias there. lag 0 = the population variance.
    Clipped at 0."""
    dev = np.asarray(x, dtype=np.float64) - np.mean(x)
    n = len(dev)
    var = float(dev @ dev) / n
    for j in range(1, min(lag, n - 1) + 1):
        var += 2.0 * min(1.0, 1.0 - (j - flat) / (lag - flat + 1)) * float(dev[j:] @ dev[:-j]) / n
    return max(var, 0.0)


def newey_west_tstat(x, lag: int) -> dict[str, float]:
    """t-statistic of the mean of `x (T,)` (time order, NaNs dropped) with the `hac_variance` standard error; lag
    h - 1 for h-day overlapping returns. {"mean", "se", "t", "n"}; se and t NaN for n < 2 or zero variance."""
    if lag < 0:
        raise DataError(f"lag={lag} must be >= 0")
    values = np.asarray(x, dtype=np.float64)
    values = values[np.isfinite(values)]
    n = len(values)
    mean = float(values.mean()) if n else math.nan
    var = hac_variance(values, lag) if n >= 2 else 0.0
    if not var > 0:
        return {"mean": mean, "se": math.nan, "t": math.nan, "n": n}
    se = math.sqrt(var / n)
    return {"mean": mean, "se": se, "t": mean / se, "n": n}


def resample_indices(n: int, n_boot: int, block: int = 1, seed: int = 0) -> np.ndarray:
    """`(n_boot, n)` bootstrap indices over `n` windows: each row concatenates ceil(n / block) blocks of consecutive
    windows starting at uniformly drawn positions in [0, n - block], cut to n (block 1 = iid)."""
    if n < 1:
        raise DataError("bootstrap needs at least one window")
    if n_boot < 1:
        raise DataError(f"n_boot={n_boot} must be >= 1")
    block = int(min(max(block, 1), n))
    rng = np.random.default_rng(seed)
    n_blocks = -(-n // block)
    starts = rng.integers(0, n - block + 1, size=(n_boot, n_blocks))  # (n_boot, n_blocks)
    idx = (starts[:, :, None] + np.arange(block)).reshape(n_boot, -1)  # (n_boot, n_blocks * block)
    return idx[:, :n]


def date_block_indices(dates: np.ndarray, n_boot: int, block: int | None = None, seed: int = 0,
                       min_block: int = 1) -> list[np.ndarray]:
    """Moving-block bootstrap over the sorted unique window dates; every window on a drawn date comes along.

    Windows of correlated series on one date are one observation, not several: resampling them independently
    would shrink the interval by up to sqrt(series). Neighbouring dates are dependent too (volatility clusters,
    and windows closer than the horizon share realised bars), hence blocks of consecutive dates.
    `dates (n,)`: any sortable key per window; block None = `default_block(D, min_block)` for D unique dates.
    Returns n_boot index arrays into the n windows (their lengths vary with the windows per date).
    """
    unique, inverse = np.unique(np.asarray(dates), return_inverse=True)
    order = np.argsort(inverse, kind="stable")  # windows grouped by date
    counts = np.bincount(inverse, minlength=len(unique))  # (D,)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # (D,) position of each date's group in `order`
    block = default_block(len(unique), min_block) if block is None else block
    out = []
    for row in resample_indices(len(unique), n_boot, block, seed):  # (D,) drawn date positions
        size = counts[row]
        pos = np.repeat(first[row] - np.cumsum(size) + size, size) + np.arange(size.sum())
        out.append(order[pos])
    return out


def default_block(n_dates: int, min_block: int = 1) -> int:
    """Dates per bootstrap block: max(min_block, round(n_dates ** (1/3))).

    n^(1/3) is the rate of the optimal block length for the mean of a weakly dependent series (Hall, Horowitz &
    Jing 1995); `min_block` (the forecast uses ceil(horizon / window stride)) keeps windows that share realised
    bars inside one block.
    """
    return max(int(min_block), round(max(n_dates, 1) ** (1 / 3)))


def bootstrap_ci(statistic: Callable[[np.ndarray], float], n: int, n_boot: int = 1000, block: int | None = 1,
                 seed: int = 0, level: float = 0.95, dates: np.ndarray | None = None,
                 min_block: int = 1) -> dict[str, float]:
    """Percentile confidence interval of `statistic` (an index array of windows -> one number, e.g.
    `lambda i: crps[i].mean()`; ratios and paired differences are computed inside it on the same indices) over
    resampled windows, or over blocks of `dates (n,)` when given (`date_block_indices`).
    Returns {"estimate" (on all windows), "low", "high", "level", "n_boot", "block", "unit"}."""
    if dates is not None:
        n_dates = len(np.unique(np.asarray(dates)))
        block = min(default_block(n_dates, min_block) if block is None else block, n_dates)
        idx = date_block_indices(dates, n_boot, block, seed)
    else:
        block = 1 if block is None else block
        idx = resample_indices(n, n_boot, block, seed)
    draws = np.array([statistic(row) for row in idx], dtype=np.float64)
    draws = draws[np.isfinite(draws)]
    alpha = (1.0 - level) / 2.0
    low, high = (np.quantile(draws, [alpha, 1.0 - alpha]) if len(draws) else (np.nan, np.nan))
    return {"estimate": float(statistic(np.arange(n))), "low": float(low), "high": float(high),
            "level": level, "n_boot": int(n_boot), "block": int(min(max(block, 1), n)),
            "unit": "dates" if dates is not None else "windows"}


def paired_test(diff, dates, lag: int = 0, level: float = 0.95, what: str = "difference",
                higher_is_better: bool = False) -> dict:
    """The verdict of the module docstring on paired differences `diff (W,)` at window `dates (W,)` (any sortable
    key; windows sharing one are averaged first; < 0 = the first better unless `higher_is_better`). `lag`: the
    dependence known in advance (h - 1 for overlapping h-step targets). `what` names the difference in the reason.
    Returns a strict-JSON-ready dict: mean (of the date means), ci_low / ci_high (the HAC t interval), dm_stat, df,
    p_value, windows, dates, lag (the bandwidth), block, blocks, windows_needed (80% power for a difference this
    size), verdict, reason."""
    frame = pd.DataFrame({"d": np.asarray(diff, dtype=np.float64), "when": np.asarray(dates)}).dropna()
    x = frame.groupby("when")["d"].mean().sort_index().to_numpy()  # (T,) date means, time order
    n_dates, mean = len(x), float(x.mean()) if len(x) else math.nan
    flat, lag = int(lag), max(2 * int(lag), int(4 * (n_dates / 100) ** (2 / 9)))
    blocks = n_dates // (lag + 1)
    lrv = hac_variance(x, lag, flat) if n_dates > 1 else 0.0
    se, df = math.sqrt(lrv / max(n_dates, 1)), max(blocks - 1, 1)
    dm = mean / se if se > 0 else math.nan
    half = float(sps.t.ppf(0.5 + level / 2, df)) * se
    needed = (Z_95 + Z_80) ** 2 * lrv / mean**2 * len(frame) / n_dates if mean and lrv > 0 else None
    out = {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "level": level, "dm_stat": dm, "df": df,
           "p_value": float(2 * sps.t.sf(abs(dm), df)) if math.isfinite(dm) else math.nan, "windows": len(frame),
           "dates": n_dates, "lag": lag, "block": lag + 1, "blocks": blocks,
           "windows_needed": None if needed is None else int(math.ceil(needed))}
    span = (f"{what} {mean:+.3g}, {level:.0%} interval [{out['ci_low']:+.3g}, {out['ci_high']:+.3g}] over "
            f"{len(frame)} windows on {n_dates} dates ({blocks} independent blocks of {lag + 1} dates)")
    if blocks < MIN_BLOCKS or not se > 0:
        out["verdict"], why = "no_evidence", f"only {blocks} independent blocks: too few for a {level:.0%} interval " \
                                             f"(at least {MIN_BLOCKS} needed: more test windows or folds)"
    elif out["ci_high"] < 0 or out["ci_low"] > 0:
        below = out["ci_high"] < 0
        out["verdict"], why = "helps" if below != higher_is_better else "hurts", \
            f"entirely {'below' if below else 'above'} 0"
    else:
        out["verdict"], why = "no_evidence", "contains 0"
        if needed:
            why += f"; about {out['windows_needed']} windows would detect a difference this size (80% power)"
    out["reason"] = f"{span}: {why}"
    return out
