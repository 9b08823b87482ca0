"""Proper scoring rules for sample ensembles (pure numpy).

Shapes: an ensemble is `samples (..., S)` with S samples on the LAST axis and `obs (...)` the realised values; every
function returns one score per observation, `(...)`, so callers average over windows / horizons as they need.

CRPS of an ensemble, with X, X' independent draws from the S samples (Gneiting & Raftery 2007):
    CRPS = E|X - y| - 1/2 E|X - X'|
The plain ("nrg") estimator averages |X_i - X_j| over all S^2 pairs (i = j included), as
`properscoring.crps_ensemble` does; the fair estimator averages over the S (S - 1) pairs with i != j, which is
unbiased for the CRPS of the distribution the samples come from and matters for small ensembles
(`scoringrules.crps_ensemble(..., estimator="fair")`). The pair sum uses the sorted-sample identity
sum_{i,j} |x_i - x_j| = 2 sum_i (2 i - S - 1) x_(i) (i = 1..S), O(S log S) instead of O(S^2).
"""

from __future__ import annotations

import numpy as np

DEFAULT_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _check(obs: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    obs = np.asarray(obs, dtype=np.float64)
    samples = np.asarray(samples, dtype=np.float64)
    if samples.ndim < 1 or samples.shape[:-1] != obs.shape:
        raise ValueError(f"samples shape {samples.shape} must be obs shape {obs.shape} + (S,)")
    if samples.shape[-1] < 1:
        raise ValueError("an ensemble needs at least one sample")
    return obs, samples


def crps_ensemble(obs: np.ndarray, samples: np.ndarray, fair: bool = False) -> np.ndarray:
    """CRPS of each ensemble against its observation.

    Parameters
    ----------
    obs : (...) realised values.
    samples : (..., S) ensemble members.
    fair : use the unbiased estimator (pairs i != j); needs S >= 2.

    Returns
    -------
    (...) CRPS, in the units of `obs`; lower is better, 0 for a perfect point mass.
    """
    obs, samples = _check(obs, samples)
    n = samples.shape[-1]
    if fair and n < 2:
        raise ValueError("the fair CRPS needs at least 2 samples per ensemble")
    spread_to_obs = np.abs(samples - obs[..., None]).mean(axis=-1)  # E|X - y|, (...)
    ranked = np.sort(samples, axis=-1)
    weights = 2.0 * np.arange(1, n + 1) - n - 1  # (S,)
    pair_sum = 2.0 * (ranked * weights).sum(axis=-1)  # sum over all ordered pairs of |x_i - x_j|, (...)
    pairs = n * (n - 1) if fair else n * n
    return spread_to_obs - 0.5 * pair_sum / pairs


def sample_quantiles(samples: np.ndarray, quantiles=DEFAULT_QUANTILES) -> np.ndarray:
    """Empirical quantiles of each ensemble (linear interpolation, numpy's default).

    Parameters
    ----------
    samples : (..., S); quantiles : (Q,) levels in (0, 1).

    Returns
    -------
    (..., Q) quantile forecasts.
    """
    q = np.asarray(quantiles, dtype=np.float64)
    if q.ndim != 1 or not np.all((q > 0) & (q < 1)):
        raise ValueError(f"quantile levels must lie strictly between 0 and 1, got {list(q)}")
    return np.moveaxis(np.quantile(np.asarray(samples, dtype=np.float64), q, axis=-1), 0, -1)


def pinball_loss(obs: np.ndarray, quantile_forecasts: np.ndarray, quantiles=DEFAULT_QUANTILES) -> np.ndarray:
    """Pinball (quantile) loss of each quantile forecast: max(q (y - f), (q - 1) (y - f)).

    Parameters
    ----------
    obs : (...); quantile_forecasts : (..., Q); quantiles : (Q,) the levels of the last axis.

    Returns
    -------
    (..., Q) losses; `sklearn.metrics.mean_pinball_loss` is their mean over observations.
    """
    q = np.asarray(quantiles, dtype=np.float64)
    diff = np.asarray(obs, dtype=np.float64)[..., None] - np.asarray(quantile_forecasts, dtype=np.float64)
    return np.maximum(q * diff, (q - 1.0) * diff)


def weighted_quantile_loss(obs: np.ndarray, quantile_forecasts: np.ndarray, quantiles=DEFAULT_QUANTILES) -> float:
    """Weighted quantile loss as Chronos reports it: mean over levels of 2 sum(pinball) / sum |y|.

    Parameters
    ----------
    obs : (N...) all observations pooled; quantile_forecasts : (N..., Q).

    Returns
    -------
    The WQL (a ratio, unit-free); NaN when every observation is 0.
    """
    loss = pinball_loss(obs, quantile_forecasts, quantiles)  # (..., Q)
    scale = np.abs(np.asarray(obs, dtype=np.float64)).sum()
    if not scale > 0:
        return float("nan")
    per_level = 2.0 * loss.reshape(-1, loss.shape[-1]).sum(axis=0) / scale  # (Q,)
    return float(per_level.mean())


def interval_coverage(obs: np.ndarray, samples: np.ndarray, level: float) -> np.ndarray:
    """Whether each observation lies in the central `level` interval of its ensemble (bounds included).

    Parameters
    ----------
    obs : (...); samples : (..., S); level : e.g. 0.5 -> the [0.25, 0.75] sample-quantile interval.

    Returns
    -------
    (...) float 1.0 inside / 0.0 outside; its mean is the coverage (a calibrated forecast covers `level`).
    """
    if not 0 < level < 1:
        raise ValueError(f"interval level must be in (0, 1), got {level}")
    obs, samples = _check(obs, samples)
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2], axis=-1)  # (2, ...) -> two (...) arrays
    return ((obs >= lo) & (obs <= hi)).astype(np.float64)
