"""Inference on forecast scores: one interval rule for the mean of a dependent series (`mean_interval`), used by
every door (`paired_test`, `session_test`, `mean_test`, metrics.json's headline intervals). How the verdict weights
windows: docs/architecture.md, "Formats and designs"; the rule itself: docs/evaluation.md, "The one interval rule"."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats as sps

from model.errors import DataError

MIN_BLOCKS = 16  # non-overlapping stretches of q + 1 dates below which no interval is claimed (8-12: AR(1) 0.9
# still fires 7%)
RHO_MARGIN = 1.5  # standard errors of rho_hat added before the Satterthwaite df (1: AR(1) 0.97 at 24 dates 7.7%)
POWER = 0.8  # the power at which the minimum detectable effect (mde) and windows_needed are stated
# The AR(1) branch (issue 51, fifth pass; docs/evaluation.md): for q = 0 and at least AR1_SPANS[0] dates, the mean's
# se^2 is s^2 (1 + a) / ((1 - a) T), a the Kendall-corrected lag-1 coefficient, and its 95% critical value is read
# from AR1_CV (AR1_SPANS x AR1_RHOS: the simulated 95% quantile of |mean| / se under a true AR(1), 30,000 runs, made
# non-decreasing in rho, rounded up; `python scripts/simulate_intervals.py table`) at a + AR1_MARGIN (by span)
# standard errors: rho_hat of an AR(1) 0.97 over 50 dates looks like an AR(1) 0.6's, and the margin keeps its size
# (1.5 at 50 dates: 8.5%). Below 50 dates the margin that holds AR(1) 0.97 (2.5) costs i.i.d. power: the HAC rule.
AR1_SPANS, AR1_MARGIN = (50, 100, 200, 500), (2.25, 1.75, 1.5, 1.5)
AR1_RHOS = (-0.9, -0.5, 0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 0.97, 0.99)
AR1_CV = ((2.06, 2.07, 2.07, 2.15, 2.31, 2.76, 3.63, 5.15, 6.66, 12.31),
          (1.97, 2.00, 2.00, 2.04, 2.12, 2.34, 2.76, 3.64, 4.68, 8.36),
          (1.94, 1.98, 1.99, 2.00, 2.04, 2.14, 2.34, 2.76, 3.36, 5.85),
          (1.92, 1.98, 1.98, 1.99, 2.00, 2.04, 2.11, 2.28, 2.53, 3.65))
AR1_FIT_P = 0.05  # Ljung-Box p-value on the AR(1) residuals below which the fit is poor and the HAC rule is used


def hac_variance(x: np.ndarray, lag: int, flat: int = 0) -> np.ndarray:
    """Long-run variance of each row of `x (..., T)` (time order), clipped at 0: g_0 + 2 sum_{l<=lag} w_l g_l, g_l
    the lag-l autocovariance (divided by T); w_l = 1 up to `flat` (a known MA(flat) dependence), then Bartlett's
    taper to 0 at lag + 1; lag 0 = the population variance. Returns `(...)`."""
    dev = np.asarray(x, dtype=np.float64)
    dev = dev - dev.mean(axis=-1, keepdims=True)
    n = dev.shape[-1]
    var = (dev * dev).sum(axis=-1) / n
    for j in range(1, min(lag, n - 1) + 1):
        var = var + 2.0 * min(1.0, 1.0 - (j - flat) / (lag - flat + 1)) * (dev[..., j:] * dev[..., :-j]).sum(-1) / n
    return np.maximum(var, 0.0)


def mean_interval(x: np.ndarray, flat: int = 0, level: float = 0.95) -> dict[str, np.ndarray]:
    """The interval rule (docs/evaluation.md) for the mean of each row of `x (R, T)` (R runs of T date values,
    time order, finite; `flat` the known overlap q; q = 0 from 50 dates on: the AR(1) branch where it fits, its df the
    t df of its critical value): {"mean", "se", "df", "half" (the half-width), "rho" (lag q + 1, or the branch's a),
    "lag", "blocks", "mde" (the smallest true mean detected with POWER, at the df "mde_df"), "clipped" (HAC variance
    clipped to 0: se floored at the i.i.d. one, df 1), "has_interval"}, arrays `(R,)` except the ints lag and blocks;
    has_interval False below MIN_BLOCKS stretches of q + 1 dates or at zero variance."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    n, q = x.shape[1], int(flat)
    h, flat = q + 1, q + 1 if q else 0  # prewhitening at lag h leaves MA(q + 1) residuals (issue 51)
    lag, stretches = max(2 * flat, int(4 * (n / 100) ** (2 / 9))), n / h
    dev = x - x.mean(axis=1, keepdims=True)
    if n // h < 4:  # the bias correction divides by 1 - 3 h / T
        nan = np.full(len(x), math.nan)
        none = np.zeros(len(x), dtype=bool)
        return {"mean": x.mean(axis=1), "se": nan, "df": nan, "half": nan, "rho": nan, "lag": lag, "blocks": 0,
                "mde": nan, "mde_df": nan, "clipped": none, "has_interval": none}
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = (dev[:, h:] * dev[:, :-h]).sum(axis=1) / (dev[:, :-h] ** 2).sum(axis=1)
    # (R,) bias-corrected lag-h coefficient: the persistence between non-overlapping targets, not the overlap's own
    rho = np.clip(np.nan_to_num((rho + 1 / stretches) / (1 - 3 / stretches)), -0.9, 0.97)
    taper = np.minimum(1.0, 1.0 - (np.arange(1, lag + 1) - flat) / (lag - flat + 1))  # (lag,) the HAC weights
    demeaned = max(1 - (1 + 2 * taper.sum()) / (n - h), 0.5)  # E[HAC] / long-run variance, the mean estimated
    se = np.sqrt(hac_variance(dev[:, h:] - rho[:, None] * dev[:, :-h], lag, flat) / demeaned / (1 - rho) ** 2 / n)
    r = np.clip(rho, 0.0, 1.0)
    blocks = max(min(n // (lag + 1), n / (1 + 2 * (taper**2).sum())), 1)  # flat weights are noisier than Bartlett's
    # Two df, the larger kept (docs/evaluation.md, issue 51): the product rule's, and Satterthwaite's for the noise of
    # the residual HAC (2 / B) plus that of the recolouring, 3 (1 + r) / (T / h (1 - r)) (delta method), r taken
    # RHO_MARGIN standard errors above the estimate because rho_hat is biased low in short persistent series.
    r_up = np.clip(rho + RHO_MARGIN * np.sqrt(np.maximum(1 - rho**2, 0) / stretches), 0.0, 0.99)
    low = np.maximum(blocks * (1 - r) / (1 + r) - 1, 1.0)  # (R,) the product rule's df
    df = np.maximum(low, 2 / (2 / blocks + 3 * (1 + r_up) / (stretches * (1 - r_up))))
    raw = np.sqrt(dev.var(axis=1) / n)  # (R,) the i.i.d. standard error: the floor when the HAC variance is clipped
    clipped = (se <= 0) & (raw > 0)
    se, df, low = np.where(clipped, raw, se), np.where(clipped, 1.0, df), np.where(clipped, 1.0, low)  # t(1): wide
    if q == 0 and n >= AR1_SPANS[0]:
        a, se1, cv, fit = ar1_interval(dev)
        # (R,) the df whose t(0.975) is the table's critical value, so p-values and other levels follow the same t
        grid = np.geomspace(1.0, 1e5, 2000)
        d1 = np.interp(-cv, -sps.t.ppf(0.975, grid), grid)
        # The mde takes a at POWER's normal quantile of its noise (s.e. sqrt((1 - a^2) / T)): power averages over
        # that noise (at a itself the mde is 0.72 of the simulated one at AR(1) 0.6, 50 dates); stated as a df so
        # that windows_needed grows it with the span: (t_0.975(d) + t_POWER(d)) se1 = (cv + z_POWER) se_POWER.
        am = np.clip(a + sps.norm.ppf(POWER) * np.sqrt((1 - a**2) / n), -0.9, 0.99)
        ratio = (cv + sps.norm.ppf(POWER)) * np.sqrt((1 + am) / (1 - am) * (1 - a) / (1 + a))
        dm = np.interp(-ratio, -(sps.t.ppf(0.975, grid) + sps.t.ppf(POWER, grid)), grid)
        use = fit & (se1 > 0) & ~clipped
        rho, se, df, low = (np.where(use, a, rho), np.where(use, se1, se), np.where(use, d1, df),
                            np.where(use, dm, low))
    # The mde at the smaller df: power averages over the df's own noise, which the larger df understates (AR(1) 0.6,
    # 50 dates: 0.71 of the simulated mde at the larger df, 0.98 at the smaller; docs/evaluation.md).
    mde = (sps.t.ppf(0.5 + level / 2, low) + sps.t.ppf(POWER, low)) * se
    return {"mean": x.mean(axis=1), "se": se, "df": df, "half": sps.t.ppf(0.5 + level / 2, df) * se, "rho": rho,
            "lag": lag, "blocks": blocks, "mde": mde, "mde_df": low, "clipped": clipped,
            "has_interval": (n // h >= MIN_BLOCKS) & (se > 0)}


def ar1_interval(dev: np.ndarray) -> tuple[np.ndarray, ...]:
    """The AR(1) branch for demeaned rows `dev (R, T)`: (a, se, cv, fit), each `(R,)`: the Kendall-corrected lag-1
    coefficient a + (1 + 3 a) / T clipped to [-0.9, 0.99], the se of the mean s^2 (1 + a) / ((1 - a) T), the 95%
    critical value (AR1_CV at a + AR1_MARGIN s.e., interpolated in log T), and whether the Ljung-Box test on the
    residuals (K = 2 + ln T lags, K - 1 df, as statsmodels' acorr_ljungbox with model_df=1) passes AR1_FIT_P."""
    n = dev.shape[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.nan_to_num((dev[:, 1:] * dev[:, :-1]).sum(axis=1) / (dev**2).sum(axis=1))
    a = np.clip(a + (1 + 3 * a) / n, -0.9, 0.99)
    se = np.sqrt((dev**2).sum(axis=1) / (n - 1) * (1 + a) / (1 - a) / n)
    at = np.interp(np.log(n), np.log(AR1_SPANS), np.arange(len(AR1_SPANS)))  # fractional row of the table
    row, w = min(int(at), len(AR1_SPANS) - 2), at - min(int(at), len(AR1_SPANS) - 2)
    up = np.clip(a + np.interp(at, np.arange(len(AR1_SPANS)), AR1_MARGIN) * np.sqrt((1 - a**2) / n), -0.9, 0.99)
    table = np.asarray(AR1_CV)
    cv = np.interp(up, AR1_RHOS, (1 - w) * table[row] + w * table[row + 1])
    e = dev[:, 1:] - a[:, None] * dev[:, :-1]
    e = e - e.mean(axis=1, keepdims=True)
    m, lags = n - 1, 2 + int(math.log(n))
    with np.errstate(divide="ignore", invalid="ignore"):
        acf = np.stack([(e[:, k:] * e[:, :-k]).sum(axis=1) for k in range(1, lags + 1)], 1) / (e**2).sum(1)[:, None]
    lb = m * (m + 2) * (np.nan_to_num(acf) ** 2 / (m - np.arange(1, lags + 1))).sum(axis=1)
    return a, se, cv, sps.chi2.sf(lb, lags - 1) >= AR1_FIT_P


def mean_test(x, lag: int = 0, level: float = 0.95) -> dict[str, float]:
    """`mean_interval` of one series `x (T,)` (time order, NaNs dropped; lag h - 1 for h-day overlapping returns):
    {"mean", "se", "t", "df", "p_value", "ci_low", "ci_high", "n"}. "t" is on the normal scale (the normal quantile
    of the rule's t(df) p-value, signed), so |t| >= 2 reads as usual and fires as often as the rule; t, p and the
    interval are NaN when the rule claims no interval (too few stretches of lag + 1 days)."""
    if lag < 0:
        raise DataError(f"lag={lag} must be >= 0")
    values = np.asarray(x, dtype=np.float64)
    values = values[np.isfinite(values)]
    r = {k: v[0] if isinstance(v, np.ndarray) else v for k, v in mean_interval(values[None], lag, level).items()}
    ok, mean, nan = bool(r["has_interval"]), float(r["mean"]) if len(values) else math.nan, math.nan
    p = float(2 * sps.t.sf(abs(mean) / r["se"], r["df"])) if ok else nan
    return {"mean": mean, "se": float(r["se"]), "df": float(r["df"]), "p_value": p,
            "t": float(np.sign(mean) * sps.norm.isf(max(p / 2, 1e-300))) if ok else nan, "n": len(values),
            "ci_low": mean - r["half"] if ok else nan, "ci_high": mean + r["half"] if ok else nan}


def session_test(diff, times, lag: int = 0, **kw) -> dict:
    """`paired_test` of `diff (W,)` over the trading sessions of the window times `times (W,)` (datetimes or int64
    ns, in the series' own wall clock): one date per session. `lag`: the known dependence in windows, kept only when
    no session holds two window times (daily or longer bars); intraday windows of one session form one value."""
    stamps = pd.DatetimeIndex(pd.to_datetime(np.asarray(times)))
    sessions = stamps.normalize()
    intraday = sessions.nunique() < stamps.nunique()
    return paired_test(diff, sessions.asi8, 0 if intraday else lag, **kw)


def paired_test(diff, dates, lag: int = 0, level: float = 0.95, what: str = "difference",
                higher_is_better: bool = False) -> dict:
    """The verdict (docs/architecture.md) on paired differences `diff (W,)` at `dates (W,)` (sortable; < 0 = the
    first better unless `higher_is_better`); `lag`: the known dependence q; `what` names the difference. Returns
    mean (over windows), ci_low / ci_high, dm_stat and p_value (None without an interval), df, windows, dates, lag
    (the bandwidth), rho, blocks, mde (the smallest true difference detected with 80% power), windows_needed (for
    80% power at this difference), verdict, reason."""
    frame = pd.DataFrame({"d": np.asarray(diff, dtype=np.float64), "when": np.asarray(dates)}).dropna()
    sums = frame.groupby("when")["d"].sum().sort_index().to_numpy()  # (T,) date totals, time order
    n_dates, n_win = len(sums), len(frame)
    x = sums * n_dates / max(n_win, 1)  # (T,) their mean is the mean over windows
    r = {k: v[0] if isinstance(v, np.ndarray) else v for k, v in mean_interval(x[None], lag, level).items()}
    mean, se, df, ok = float(r["mean"]) if n_dates else math.nan, float(r["se"]), float(r["df"]), r["has_interval"]
    dm = mean / se if ok else math.nan
    mde = float(r["mde"]) if ok else math.nan
    needed = windows_needed(mean, se, float(r["mde_df"]), n_win, level) if ok else None
    out = {"mean": mean, "ci_low": mean - r["half"] if ok else None, "ci_high": mean + r["half"] if ok else None,
           "level": level, "dm_stat": dm, "df": df, "p_value": float(2 * sps.t.sf(abs(dm), df)) if ok else math.nan,
           "windows": n_win, "dates": n_dates, "lag": int(r["lag"]), "rho": float(r["rho"]),
           "blocks": n_dates // (int(lag) + 1), "mde": mde, "windows_needed": needed}
    span = f"{what} {mean:+.3g} over {n_win} windows on {n_dates} dates or sessions"
    if not ok:
        out["verdict"] = "no_evidence"
        why = (f"no {level:.0%} interval: only {out['blocks']} non-overlapping stretches of {int(lag) + 1} dates "
               f"(at least {MIN_BLOCKS} needed: about {MIN_BLOCKS * (int(lag) + 1) - n_dates} more dates or sessions "
               "of test data -- days on a 24/7 market -- or more folds)" if out["blocks"] < MIN_BLOCKS
               else f"no {level:.0%} interval: the differences do not vary")
    else:
        span += f", {level:.0%} interval [{out['ci_low']:+.3g}, {out['ci_high']:+.3g}] (t with {df:.1f} df)"
        if r["clipped"]:
            span += " -- wide: the dependence-robust variance came out negative, floored at the i.i.d. one with 1 df"
        if out["ci_high"] < 0 or out["ci_low"] > 0:
            below = out["ci_high"] < 0
            out["verdict"], why = "helps" if below != higher_is_better else "hurts", \
                f"entirely {'below' if below else 'above'} 0"
        else:
            out["verdict"], why = "no_evidence", (f"contains 0; these data detect only a true difference of at least "
                                                  f"{mde:.3g} in size ({POWER:.0%} power)")
            if needed:
                why += f"; about {needed} windows would detect a difference the size of this one"
    out["reason"] = f"{span}: {why}"
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in out.items()}  # strict JSON


def windows_needed(mean: float, se: float, df: float, n_win: int, level: float = 0.95) -> int | None:
    """Windows at which the rule detects a true difference `mean` with POWER, from this run's variance per window
    se^2 n_win and its df grown in proportion (the rule's effective sample scales with the span); None at mean 0."""
    if not mean or not se > 0:
        return None
    need = float(n_win)
    for _ in range(20):  # fixed point: the critical values fall as the df grow with the windows
        d = max(df * need / n_win, 1.0)
        need = ((sps.t.ppf(0.5 + level / 2, d) + sps.t.ppf(POWER, d)) * se / abs(mean)) ** 2 * n_win
    return int(math.ceil(need))
