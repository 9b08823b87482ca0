"""Proper scoring rules for sample ensembles (numpy; pandas reads the bars' spacing in `infer_season`): `samples (...,
S)` with S samples on the LAST axis and `obs (...)` give one score per observation, `(...)`. Every score uses the
fair CRPS estimator; why, and the O(S log S) pair sum: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from finetune.evaluation.statistics import paired_test, session_test
from model.errors import DataError
from model.fileio import strict_json

DEFAULT_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _check(obs: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    obs = np.asarray(obs, dtype=np.float64)
    samples = np.asarray(samples, dtype=np.float64)
    if samples.ndim < 1 or samples.shape[:-1] != obs.shape:
        raise DataError(f"samples shape {samples.shape} must be obs shape {obs.shape} + (S,)")
    if samples.shape[-1] < 1:
        raise DataError("an ensemble needs at least one sample")
    return obs, samples


def crps_ensemble(obs: np.ndarray, samples: np.ndarray, fair: bool = False) -> np.ndarray:
    """CRPS `(...)` of each ensemble `samples (..., S)` against `obs (...)`, in the units of `obs` (0 for a perfect
    point mass). `fair`: the unbiased estimator over pairs i != j (S = 1: a point forecast, scored exactly)."""
    obs, samples = _check(obs, samples)
    n = samples.shape[-1]
    spread_to_obs = np.abs(samples - obs[..., None]).mean(axis=-1)  # E|X - y|, (...)
    ranked = np.sort(samples, axis=-1)
    weights = 2.0 * np.arange(1, n + 1) - n - 1  # (S,)
    pair_sum = 2.0 * (ranked * weights).sum(axis=-1)  # sum over all ordered pairs of |x_i - x_j|, (...)
    pairs = max(n * (n - 1), 1) if fair else n * n
    return spread_to_obs - 0.5 * pair_sum / pairs


def sample_quantiles(samples: np.ndarray, quantiles=DEFAULT_QUANTILES) -> np.ndarray:
    """Empirical quantiles `(..., Q)` of each ensemble `samples (..., S)` (numpy's linear interpolation)."""
    q = np.asarray(quantiles, dtype=np.float64)
    if q.ndim != 1 or not np.all((q > 0) & (q < 1)):
        raise DataError(f"quantile levels must lie strictly between 0 and 1, got {list(q)}")
    return np.moveaxis(np.quantile(np.asarray(samples, dtype=np.float64), q, axis=-1), 0, -1)


def pinball_loss(obs: np.ndarray, quantile_forecasts: np.ndarray, quantiles=DEFAULT_QUANTILES) -> np.ndarray:
    """Pinball loss `(..., Q)` of `quantile_forecasts (..., Q)` against `obs (...)`: max(q (y - f), (q - 1) (y - f));
    `sklearn.metrics.mean_pinball_loss` is its mean over observations."""
    q = np.asarray(quantiles, dtype=np.float64)
    diff = np.asarray(obs, dtype=np.float64)[..., None] - np.asarray(quantile_forecasts, dtype=np.float64)
    return np.maximum(q * diff, (q - 1.0) * diff)


def weighted_quantile_loss(obs: np.ndarray, quantile_forecasts: np.ndarray, quantiles=DEFAULT_QUANTILES) -> float:
    """Weighted quantile loss as Chronos reports it, over all observations pooled: mean over levels of
    2 sum(pinball) / sum |y| (unit-free; NaN when every observation is 0)."""
    loss = pinball_loss(obs, quantile_forecasts, quantiles)  # (..., Q)
    scale = np.abs(np.asarray(obs, dtype=np.float64)).sum()
    if not scale > 0:
        return float("nan")
    per_level = 2.0 * loss.reshape(-1, loss.shape[-1]).sum(axis=0) / scale  # (Q,)
    return float(per_level.mean())


def interval_coverage(obs: np.ndarray, samples: np.ndarray, level: float) -> np.ndarray:
    """`(...)` 1.0 where `obs` lies in the central `level` interval of its ensemble (bounds included), else 0.0;
    level 0.5 is the [0.25, 0.75] sample-quantile interval."""
    if not 0 < level < 1:
        raise DataError(f"interval level must be in (0, 1), got {level}")
    obs, samples = _check(obs, samples)
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2], axis=-1)  # (2, ...) -> two (...) arrays
    return ((obs >= lo) & (obs <= hi)).astype(np.float64)


def coverage_test(covered: np.ndarray, dates, level: float, lag: int = 0) -> dict:
    """Is the held-out coverage of a central `level` band off nominal? `covered (W, H)` 0/1 (`interval_coverage`) of
    W windows at `dates (W,)` (datetimes: sessions are the unit, `session_test`): the interval rule on each window's
    share covered minus `level`, so dependence across horizons, windows of one session and overlapping windows
    (`lag` = q) widens the error bar; the binomial error over sessions it replaces flagged correct bands 11-17% of
    the time under clustered volatility and 43-46% with overlapping windows. Verdict "under" / "over" (its interval
    below / above 0: off nominal) or "no_evidence" (consistent with nominal, or too few sessions to tell)."""
    when = np.asarray(dates)
    test = session_test if np.issubdtype(when.dtype, np.datetime64) else paired_test
    out = test(np.asarray(covered, dtype=np.float64).mean(axis=1) - level, when, lag,
               what=f"{level:.0%} band coverage - nominal")
    return out | {"verdict": {"helps": "under", "hurts": "over"}.get(out["verdict"], "no_evidence")}


DAYS_PER_WEEK = 5  # trading days: the season of daily bars


def persistence_samples(last_close: np.ndarray, horizon: int) -> np.ndarray:
    """Random-walk forecast `(W, 1, H)` from `last_close (W,)`: every future value equals the last observed one."""
    last = np.asarray(last_close, dtype=np.float64)
    return np.repeat(last[:, None, None], horizon, axis=2)


def empirical_samples(history: np.ndarray, horizon: int, window: int = 250) -> np.ndarray:
    """Probabilistic naive forecast: the market's own recent H-bar paths, rescaled to the last close.

    Path k is the realised path that started at the k-th bar t_k of the trailing `window` bars:
    sample[k, h] = last * close[t_k + h] / close[t_k] for h = 1..H. It has the spread of recent returns and no
    view on their direction, so a model must beat it to claim its bands carry information.
    `history (W, T)`: NaN-free closes ending at the last context bar, T >= H + 1. Returns `(W, S, H)` with
    S = min(window, T - 1) - H + 1 paths."""
    history = np.asarray(history, dtype=np.float64)
    if history.ndim != 2 or history.shape[1] < horizon + 1:
        raise DataError(f"history of shape {history.shape} is shorter than horizon + 1 = {horizon + 1} bars")
    tail = history[:, -min(window, history.shape[1] - 1) - 1:]  # (W, n+1): n returns' worth of bars
    n_paths = tail.shape[1] - horizon  # start bars t_k with t_k + H inside the tail
    starts = np.arange(n_paths)  # (S,)
    steps = np.arange(1, horizon + 1)  # (H,)
    rel = tail[:, starts[:, None] + steps[None, :]] / tail[:, starts, None]  # (W, S, H)
    return history[:, -1, None, None] * rel


def seasonal_naive_samples(context: np.ndarray, horizon: int, season) -> np.ndarray:
    """Seasonal-naive forecast `(W, 1, H)` from `context (W, L)` and the season m (an int, or `(W,)` per window: a
    daily and an hourly series have different seasons), L >= m: horizon h (1-based) repeats the value one season
    earlier, context[L - m + (h-1) % m]."""
    context = np.asarray(context, dtype=np.float64)
    m = np.broadcast_to(np.asarray(season, dtype=np.int64), context.shape[:1])[:, None]  # (W, 1)
    if (m < 1).any():
        raise DataError(f"season={np.min(m)} must be >= 1")
    if context.ndim != 2 or context.shape[1] < m.max(initial=1):
        raise DataError(f"context of shape {context.shape} is shorter than one season ({m.max()} bars); "
                        "lengthen the lookback or set the season explicitly")
    cols = context.shape[1] - m + (np.arange(horizon) % m)  # (W, H)
    return np.take_along_axis(context, cols, axis=1)[:, None]


def infer_season(timestamps) -> int:
    """The season of one series' ascending `timestamps (N,)`: bars per trading day for intraday data, else 5 (a
    trading week of daily bars); DataError for spacings of more than a day."""
    stamps = pd.DatetimeIndex(pd.to_datetime(np.asarray(timestamps)))
    if len(stamps) < 2:
        raise DataError("need at least two timestamps to infer the season; set it explicitly")
    step = pd.Series(stamps).diff().dropna().median()
    if step < pd.Timedelta(days=1):
        return int(pd.Series(stamps.normalize()).value_counts().median())
    if step <= pd.Timedelta(days=1):
        return DAYS_PER_WEEK
    raise DataError(f"bars are {step} apart; the season cannot be inferred, set it explicitly")


@dataclass
class ScoreSettings:
    """How forecasts are scored."""

    quantiles: tuple[float, ...] = DEFAULT_QUANTILES  # Quantile levels of the pinball loss and WQL.
    intervals: tuple[float, ...] = (0.5, 0.8)  # Central interval levels whose coverage is reported.
    # Season of the seasonal-naive baseline in bars (bars per day / week), one for all series or {series: season};
    # None = no seasonal-naive baseline.
    season: int | dict[str, int] | None = None
    # Windows closer than the horizon share realised bars: the known dependence is q = min_block - 1 dates.
    min_block: int = 1
    # Trailing bars whose H-bar paths form the `empirical` baseline (needs the history, see `score_forecasts`).
    empirical_window: int = 250
    level: float = 0.95  # Confidence level of the intervals.


def _check_inputs(samples, realised, last_close, context, series) -> tuple:
    samples = np.asarray(samples, dtype=np.float64)
    realised = np.asarray(realised, dtype=np.float64)
    last_close = np.asarray(last_close, dtype=np.float64)
    problems = []
    if samples.ndim != 3:
        problems.append(f"samples must be (windows, samples, horizons), got shape {samples.shape}")
    elif realised.shape != (samples.shape[0], samples.shape[2]):
        problems.append(f"realised must be (windows, horizons) = {(samples.shape[0], samples.shape[2])}, "
                        f"got {realised.shape}")
    if samples.ndim == 3 and last_close.shape != (samples.shape[0],):
        problems.append(f"last_close must be (windows,), got {last_close.shape}")
    elif not np.all(np.isfinite(last_close) & (last_close != 0)):
        problems.append("last_close must be finite and non-zero (returns are measured from it)")
    if not problems and not (np.isfinite(samples).all() and np.isfinite(realised).all()):
        problems.append("samples and realised must be finite (drop windows with missing future values first)")
    if context is not None:
        context = np.asarray(context, dtype=np.float64)
        if context.ndim != 2 or context.shape[0] != len(last_close) or context.shape[1] < 2:
            problems.append(f"context must be (windows, lookback >= 2), got {context.shape}")
    if series is None:
        series = np.zeros(len(last_close), dtype=np.int64)
    series = np.asarray(series)
    if series.shape != last_close.shape:
        problems.append(f"series must be (windows,), got {series.shape}")
    if problems:
        raise DataError("cannot score forecasts:\n  " + "\n  ".join(problems))
    return samples, realised, last_close, context, series


def _in_sample_scale(context: np.ndarray, codes: np.ndarray, n_series: int) -> np.ndarray:
    """(W,) MASE denominator of each window: its series' mean |one-step return| over all its windows' contexts."""
    with np.errstate(divide="ignore", invalid="ignore"):
        naive = np.abs(context[:, 1:] / context[:, :-1] - 1.0)  # (W, L-1)
    per_window = np.nanmean(np.where(np.isfinite(naive), naive, np.nan), axis=1)  # (W,)
    sums = np.bincount(codes, np.nan_to_num(per_window), minlength=n_series)
    counts = np.bincount(codes, np.isfinite(per_window), minlength=n_series)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = sums / counts  # (n_series,)
    scale = np.where(scale > 0, scale, np.nan)  # a flat series has no naive error: its MASE is undefined
    return scale[codes]


def _series_mean(values: np.ndarray, codes: np.ndarray, n_series: int, idx: np.ndarray) -> float:
    """Mean over series (equal weight) of the mean of `values (W,)` over that series' windows in `idx`."""
    v, c = values[idx], codes[idx]
    ok = np.isfinite(v)
    sums = np.bincount(c[ok], v[ok], minlength=n_series)
    counts = np.bincount(c[ok], minlength=n_series)
    present = counts > 0
    return float((sums[present] / counts[present]).mean()) if present.any() else math.nan


def window_scores(pred_ret: np.ndarray, obs_ret: np.ndarray, settings: ScoreSettings) -> dict[str, np.ndarray]:
    """Per-window, per-horizon scores of one ensemble `pred_ret (W, S, H)` against `obs_ret (W, H)`."""
    ens = np.moveaxis(pred_ret, 1, -1)  # (W, H, S): samples last, as the scoring rules take them
    quant = sample_quantiles(ens, settings.quantiles)  # (W, H, Q)
    point = np.median(ens, axis=-1)  # (W, H)
    out = {"abs_err": np.abs(point - obs_ret), "crps": crps_ensemble(obs_ret, ens, fair=True),
           "crps_plain": crps_ensemble(obs_ret, ens), "quantiles": quant,
           "pinball": pinball_loss(obs_ret, quant, settings.quantiles),
           "direction_hit": ((point[:, -1] > 0) == (obs_ret[:, -1] > 0)).astype(np.float64),
           "samples": ens.shape[-1]}  # shown beside every score: the plain CRPS depends on it
    for level in settings.intervals:
        out[f"coverage_{round(level * 100)}"] = interval_coverage(obs_ret, ens, level)
    return out


def _summarise(scores: dict, obs_ret: np.ndarray, scaled: np.ndarray | None, codes: np.ndarray, n_series: int,
               settings: ScoreSettings, direction: bool) -> dict:
    """Per-horizon and overall numbers of one forecaster; `scaled (W, H)` = abs_err / series scale."""
    all_w = np.arange(len(obs_ret))
    per_h = {"mae": scores["abs_err"].mean(axis=0), "crps": scores["crps"].mean(axis=0),
             "wql": np.array([weighted_quantile_loss(obs_ret[:, h], scores["quantiles"][:, h], settings.quantiles)
                              for h in range(obs_ret.shape[1])])}
    overall = {"mae": scores["abs_err"].mean(), "crps": scores["crps"].mean(),
               "wql": weighted_quantile_loss(obs_ret, scores["quantiles"], settings.quantiles),
               "pinball": {f"{q:g}": v for q, v in zip(settings.quantiles, scores["pinball"].mean(axis=(0, 1)))}}
    for key in [k for k in scores if k == "crps_plain" or k.startswith("coverage_")]:
        per_h[key], overall[key] = scores[key].mean(axis=0), scores[key].mean()
    if scaled is not None:
        per_h["mase"] = np.array([_series_mean(scaled[:, h], codes, n_series, all_w) for h in range(scaled.shape[1])])
        overall["mase"] = _series_mean(scaled.mean(axis=1), codes, n_series, all_w)
    overall["direction_accuracy"] = scores["direction_hit"].mean() if direction else None
    overall["samples"] = int(scores["samples"])
    return {"per_horizon": {k: v.tolist() for k, v in per_h.items()}, "overall": overall}


def score_forecasts(samples, realised, last_close, context=None, series=None,
                    settings: ScoreSettings | None = None, history=None, dates=None) -> dict:
    """Score a forecast run and its naive baselines.

    samples (W, S, H), realised (W, H), last_close (W,), context (W, L) closes, series (W,) names;
    history (W, T) closes ending at the last context bar, T > H (the `empirical` baseline uses its trailing
    `settings.empirical_window` bars); dates (W,) window dates (datetimes: one unit per trading session): the
    intervals' unit (windows of every series on one date are one observation), else each window is its own date.
    Returns a strict-JSON dict: "setup", "model", "persistence", ["empirical"], ["seasonal_naive"], "direction",
    "skill" (1 - model / baseline for MAE, CRPS, MASE), "intervals" (the headline numbers' intervals), "versus"
    (the model minus each baseline: `paired_test`), "per_series" (list of rows). CRPS is the fair estimator
    throughout; each forecaster's "overall" holds its "samples" and "crps_plain"."""
    settings = settings or ScoreSettings()
    samples, realised, last_close, context, series = _check_inputs(samples, realised, last_close, context, series)
    n_windows, n_samples, horizon = samples.shape
    names, codes = np.unique(series.astype(str), return_inverse=True)
    n_series = len(names)
    obs_ret = realised / last_close[:, None] - 1.0  # (W, H)
    scale = _in_sample_scale(context, codes, n_series) if context is not None else None  # (W,)

    forecasters = {"model": samples, "persistence": persistence_samples(last_close, horizon)}
    if history is not None:
        forecasters["empirical"] = empirical_samples(history, horizon, settings.empirical_window)
    season = settings.season  # {series: season} of the series scored here, or one number when they agree
    if isinstance(season, dict):
        season = {str(n): season[n] for n in names} if len({season[n] for n in names}) > 1 else season[names[0]]
    if season is not None:
        if context is None:
            raise DataError("a seasonal-naive baseline (season) needs the context values")
        per_window = np.array([season[n] for n in names])[codes] if isinstance(season, dict) else season  # (W,)
        forecasters["seasonal_naive"] = seasonal_naive_samples(context, horizon, per_window)
    result = {"setup": {"windows": n_windows, "samples": n_samples, "horizon": horizon, "series": n_series,
                        "season": season, "space": "return relative to the last observed close",
                        "empirical_paths": forecasters["empirical"].shape[1] if history is not None else None,
                        "point_forecast": "sample median", "quantiles": list(settings.quantiles)}}
    by_name = {}  # forecaster -> its per-window scores
    for name, ens in forecasters.items():
        sc = window_scores(ens / last_close[:, None, None] - 1.0, obs_ret, settings)
        scaled = sc["abs_err"] / scale[:, None] if scale is not None else None
        sc["scaled"] = scaled
        by_name[name] = sc
        result[name] = _summarise(sc, obs_ret, scaled, codes, n_series, settings, direction=name != "persistence")

    share_up = float((obs_ret[:, -1] > 0).mean())
    result["direction"] = {"horizon": horizon, "accuracy": result["model"]["overall"]["direction_accuracy"],
                           "share_up": share_up, "coin": 0.5, "majority_class": max(share_up, 1.0 - share_up)}
    result["skill"] = {}
    for baseline in [b for b in ("persistence", "empirical") if b in result]:
        base = result[baseline]["overall"]
        result["skill"].update({f"{k}_vs_{baseline}": 1.0 - result["model"]["overall"][k] / base[k]
                                if base.get(k) else None for k in ("mae", "crps", "mase") if k in base})
    result["intervals"] = _intervals(by_name["model"], dates, settings)
    # Paired differences get the one interval rule of every report (statistics.paired_test, sessions as dates).
    when = np.arange(n_windows) if dates is None else np.asarray(dates)
    test = session_test if np.issubdtype(when.dtype, np.datetime64) else paired_test
    result["versus"] = {name: test(by_name["model"]["crps"].mean(axis=1) - by_name[name]["crps"].mean(axis=1),
                                   when, settings.min_block - 1, what=f"CRPS model - {name}")
                        for name in by_name if name != "model"}
    result["per_series"] = _per_series(by_name["model"], names, codes)
    return strict_json(result)


def _intervals(model: dict, dates: np.ndarray | None, settings: ScoreSettings) -> dict:
    """The model's headline numbers (means over windows) with the interval rule's interval (`paired_test` of each
    window's value: dates or sessions as the unit, q = min_block - 1); low / high None where it claims none."""
    values = {"mae": model["abs_err"].mean(axis=1), "crps": model["crps"].mean(axis=1),
              "direction_accuracy": model["direction_hit"]}
    if model["scaled"] is not None:
        values["mase"] = model["scaled"].mean(axis=1)
    when = np.arange(len(values["mae"])) if dates is None else np.asarray(dates)
    test = session_test if np.issubdtype(when.dtype, np.datetime64) else paired_test
    out = {}
    for key, v in values.items():
        t = test(v, when, settings.min_block - 1, level=settings.level, what=key)
        out[key] = {"estimate": t["mean"], "low": t["ci_low"], "high": t["ci_high"], "level": settings.level,
                    "dates": t["dates"], "reason": t["reason"]}
    return out


def _per_series(scores: dict, names: np.ndarray, codes: np.ndarray) -> list[dict]:
    """One row per series: window count and the model's overall numbers on that series' windows."""
    rows = []
    for k, name in enumerate(names):
        w = codes == k
        row = {"series": str(name), "windows": int(w.sum()), "mae": scores["abs_err"][w].mean(),
               "crps": scores["crps"][w].mean(), "direction_accuracy": scores["direction_hit"][w].mean()}
        if scores["scaled"] is not None:
            row["mase"] = scores["scaled"][w].mean()
        for key in [c for c in scores if c.startswith("coverage_")]:
            row[key] = scores[key][w].mean()
        rows.append(row)
    return rows
