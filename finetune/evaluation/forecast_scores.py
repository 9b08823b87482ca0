"""Score a probabilistic forecast run (CSV pipeline): one nested, strict-JSON dict for metrics.json + a short summary.

Inputs, for W forecast windows, S samples and H horizons:
    samples    (W, S, H)  sampled future values of the target (e.g. close)
    realised   (W, H)     the values that came
    last_close (W,)       the last observed value of each window
    context    (W, L)     optional lookback values (MASE scale, seasonal-naive baseline)
    series     (W,)       optional series name of each window (per-series table; MASE scale per series)

Everything is scored in RETURN space relative to the last observed close, r = value / last_close - 1, so a
high-priced series does not dominate the pooled error. The point forecast is the sample median (optimal for MAE).
MASE divides each series' MAE by that series' in-sample one-step naive error, mean |c_t / c_{t-1} - 1| over the
contexts of its windows, and averages series with equal weight. Direction is the sign of the last-horizon return
(up = > 0) of the median forecast, against a coin (0.5) and the majority class of the scored windows (in hindsight,
so an upper bound for a constant guess). Persistence and seasonal-naive baselines are scored by the same functions;
bootstrap intervals resample windows (blocks of `block` consecutive windows) with one seed, the model-minus-
persistence differences on the same resamples (paired).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from finetune.evaluation.bootstrap import bootstrap_ci
from finetune.evaluation.forecast_baselines import (
    persistence_samples,
    seasonal_naive_samples,
)
from finetune.evaluation.scoring_rules import (
    DEFAULT_QUANTILES,
    crps_ensemble,
    interval_coverage,
    pinball_loss,
    sample_quantiles,
    weighted_quantile_loss,
)
from model.fileio import strict_json


@dataclass
class ScoreSettings:
    """How forecasts are scored."""

    quantiles: tuple[float, ...] = DEFAULT_QUANTILES
    """Quantile levels of the pinball loss and WQL."""
    intervals: tuple[float, ...] = (0.5, 0.8)
    """Central interval levels whose coverage is reported."""
    season: int | None = None
    """Season of the seasonal-naive baseline in bars (bars per day / week); None = no seasonal-naive baseline."""
    n_boot: int = 1000
    """Bootstrap resamples for confidence intervals (0 = none)."""
    block: int = 1
    """Bootstrap block length in consecutive windows (1 = iid)."""
    level: float = 0.95
    """Confidence level of the bootstrap intervals."""
    seed: int = 0
    """Seed of the bootstrap."""


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
        raise ValueError("cannot score forecasts:\n  " + "\n  ".join(problems))
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


def _window_scores(pred_ret: np.ndarray, obs_ret: np.ndarray, settings: ScoreSettings) -> dict[str, np.ndarray]:
    """Per-window, per-horizon scores of one ensemble `pred_ret (W, S, H)` against `obs_ret (W, H)`."""
    ens = np.moveaxis(pred_ret, 1, -1)  # (W, H, S): samples last, as the scoring rules take them
    quant = sample_quantiles(ens, settings.quantiles)  # (W, H, Q)
    point = np.median(ens, axis=-1)  # (W, H)
    out = {"abs_err": np.abs(point - obs_ret), "crps": crps_ensemble(obs_ret, ens),
           "quantiles": quant, "pinball": pinball_loss(obs_ret, quant, settings.quantiles),
           "direction_hit": ((point[:, -1] > 0) == (obs_ret[:, -1] > 0)).astype(np.float64)}
    if ens.shape[-1] >= 2:
        out["crps_fair"] = crps_ensemble(obs_ret, ens, fair=True)
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
    if "crps_fair" in scores:
        per_h["crps_fair"], overall["crps_fair"] = scores["crps_fair"].mean(axis=0), scores["crps_fair"].mean()
    if scaled is not None:
        per_h["mase"] = np.array([_series_mean(scaled[:, h], codes, n_series, all_w) for h in range(scaled.shape[1])])
        overall["mase"] = _series_mean(scaled.mean(axis=1), codes, n_series, all_w)
    for key in [k for k in scores if k.startswith("coverage_")]:
        per_h[key], overall[key] = scores[key].mean(axis=0), scores[key].mean()
    overall["direction_accuracy"] = scores["direction_hit"].mean() if direction else None
    return {"per_horizon": {k: v.tolist() for k, v in per_h.items()}, "overall": overall}


def score_forecasts(samples, realised, last_close, context=None, series=None,
                    settings: ScoreSettings | None = None) -> dict:
    """Score a forecast run and its persistence / seasonal-naive baselines (shapes: see the module docstring).

    Returns
    -------
    Nested dict, strict JSON (NaN -> None): "setup", "model", "persistence", ["seasonal_naive"], "direction",
    "skill" (1 - model / persistence for MAE, CRPS, MASE), "bootstrap" (CIs), "per_series" (list of rows).
    """
    settings = settings or ScoreSettings()
    samples, realised, last_close, context, series = _check_inputs(samples, realised, last_close, context, series)
    n_windows, n_samples, horizon = samples.shape
    names, codes = np.unique(series.astype(str), return_inverse=True)
    n_series = len(names)
    obs_ret = realised / last_close[:, None] - 1.0  # (W, H)
    scale = _in_sample_scale(context, codes, n_series) if context is not None else None  # (W,)

    forecasters = {"model": samples, "persistence": persistence_samples(last_close, horizon)}
    if settings.season is not None:
        if context is None:
            raise ValueError("a seasonal-naive baseline (season) needs the context values")
        forecasters["seasonal_naive"] = seasonal_naive_samples(context, horizon, settings.season)
    result = {"setup": {"windows": n_windows, "samples": n_samples, "horizon": horizon, "series": n_series,
                        "season": settings.season, "space": "return relative to the last observed close",
                        "point_forecast": "sample median", "quantiles": list(settings.quantiles)}}
    window_scores = {}
    for name, ens in forecasters.items():
        sc = _window_scores(ens / last_close[:, None, None] - 1.0, obs_ret, settings)
        scaled = sc["abs_err"] / scale[:, None] if scale is not None else None
        sc["scaled"] = scaled
        window_scores[name] = sc
        result[name] = _summarise(sc, obs_ret, scaled, codes, n_series, settings, direction=name != "persistence")

    share_up = float((obs_ret[:, -1] > 0).mean())
    result["direction"] = {"horizon": horizon, "accuracy": result["model"]["overall"]["direction_accuracy"],
                           "share_up": share_up, "coin": 0.5, "majority_class": max(share_up, 1.0 - share_up)}
    base = result["persistence"]["overall"]
    result["skill"] = {f"{k}_vs_persistence": 1.0 - result["model"]["overall"][k] / base[k]
                       if base.get(k) else None for k in ("mae", "crps", "mase") if k in base}
    result["bootstrap"] = _bootstrap(window_scores, codes, n_series, settings) if settings.n_boot > 0 else None
    result["per_series"] = _per_series(window_scores["model"], names, codes)
    return strict_json(result)


def _bootstrap(window_scores: dict, codes: np.ndarray, n_series: int, settings: ScoreSettings) -> dict:
    """CIs over windows of the model's headline numbers and paired differences to persistence."""
    model, naive = window_scores["model"], window_scores["persistence"]
    n = len(codes)
    stats = {"mae": lambda i: model["abs_err"][i].mean(), "crps": lambda i: model["crps"][i].mean(),
             "direction_accuracy": lambda i: model["direction_hit"][i].mean(),
             "crps_minus_persistence": lambda i: (model["crps"][i] - naive["crps"][i]).mean(),
             "mae_minus_persistence": lambda i: (model["abs_err"][i] - naive["abs_err"][i]).mean()}
    if model["scaled"] is not None:
        scaled_m, scaled_p = model["scaled"].mean(axis=1), naive["scaled"].mean(axis=1)  # (W,)
        stats["mase"] = lambda i: _series_mean(scaled_m, codes, n_series, i)
        stats["mase_minus_persistence"] = lambda i: (_series_mean(scaled_m, codes, n_series, i)
                                                     - _series_mean(scaled_p, codes, n_series, i))
    return {k: bootstrap_ci(f, n, settings.n_boot, settings.block, settings.seed, settings.level)
            for k, f in stats.items()}


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


def format_summary(scores: dict) -> str:
    """A few lines for the console from a `score_forecasts` result."""
    s = scores["setup"]
    lines = [(f"forecast scores: {s['windows']} windows x {s['horizon']} horizons, {s['samples']} samples, "
              f"{s['series']} series (returns vs last close)"),
             f"{'':16}{'MAE':>9}{'MASE':>8}{'CRPS':>9}{'WQL':>7}{'cov50':>7}{'cov80':>7}"]

    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    for name in ("model", "persistence", "seasonal_naive"):
        if name in scores:
            o = scores[name]["overall"]
            label = f"seasonal({s['season']})" if name == "seasonal_naive" else name
            lines.append(f"{label:16}{num(o['mae'], '9.5f')}{num(o.get('mase'), '8.3f')}{num(o['crps'], '9.5f')}"
                         f"{num(o['wql'], '7.3f')}{num(o.get('coverage_50'), '7.2f')}"
                         f"{num(o.get('coverage_80'), '7.2f')}")
    boot = scores.get("bootstrap")
    if boot:
        ci = boot["crps_minus_persistence"]
        lines.append(f"CRPS - persistence: {ci['estimate']:+.5f} [{ci['low']:+.5f}, {ci['high']:+.5f}] "
                     f"({ci['level']:.0%} CI, block {ci['block']})")
    d = scores["direction"]
    lines.append(f"direction at h={d['horizon']}: {num(d['accuracy'], '.3f')} vs coin 0.500, "
                 f"majority class {d['majority_class']:.3f}")
    return "\n".join(lines)
