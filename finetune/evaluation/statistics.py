"""Inference on forecast scores: one interval rule for the mean of a dependent series (`mean_interval`), used by
every door (`paired_test`, `session_test`, `mean_test`, metrics.json's headline intervals). How the verdict weights
windows: docs/architecture.md, "Formats and designs"; the rule itself: docs/evaluation.md, "The one interval rule"."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as sps

from model.errors import DataError

MIN_BLOCKS = 16  # non-overlapping stretches of q + 1 dates below which no interval is claimed (8-12: AR(1) 0.9
# still fires 7%)
RHO_MARGIN = 1.5  # standard errors of rho_hat added before the Satterthwaite df (1: AR(1) 0.97 at 24 dates 7.7%)
POWER = 0.8  # the power at which the minimum detectable effect (mde) and windows_needed are stated
# The AR(1) branch (issue 51, seventh pass; docs/evaluation.md): for q = 0 and at least AR1_SPANS[0] dates, the
# mean's se^2 is s^2 (1 + a) / ((1 - a) T), a the Kendall-corrected lag-1 coefficient, and its 95% critical value
# cv(a, T) is read from AR1_TABLE (rows AR1_SPANS, interpolated in log T; columns AR1_A, linear in a): per span the
# rejection region |mean| / se >= cv(a) of largest average power over AR(1) alternatives whose size is at most 5% under
# every AR(1) from -0.9 to 0.99 (a linear programme over simulated (a, |t|) cells; `python scripts/
# simulate_intervals.py table`). A margin on a (the fifth pass) spent the size budget where AR(1) 0.6 lives.
AR1_SPANS = (24, 32, 50, 100, 200, 500, 1000, 2000)
AR1_A = np.round(np.r_[np.arange(-0.88, 0.97, 0.04), 0.98], 2)  # (48,) the table's columns: a past 0.97 apart
AR1_TABLE = Path(__file__).with_name("ar1_critical_values.csv")
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
    time order, finite; `flat` the known overlap q; q = 0 from AR1_SPANS[0] dates on: the AR(1) branch where it fits,
    its df the t df of its critical value): {"mean", "se", "df", "half" (the half-width), "rho" (lag q + 1, or the
    branch's a), "lag", "blocks", "mde" (the smallest true mean detected with POWER; the HAC rule's at the df
    "mde_df"), "clipped" (HAC variance clipped to 0: se floored at the i.i.d. one, df 1), "ar1" (the branch used),
    "persistent" (the branch's table has no critical value: half inf), "has_interval"}, arrays `(R,)` except the ints
    lag and blocks; has_interval False below MIN_BLOCKS stretches of q + 1 dates, at zero variance, or persistent."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    n, q = x.shape[1], int(flat)
    h, flat = q + 1, q + 1 if q else 0  # prewhitening at lag h leaves MA(q + 1) residuals (issue 51)
    lag, stretches = max(2 * flat, int(4 * (n / 100) ** (2 / 9))), n / h
    dev = x - x.mean(axis=1, keepdims=True)
    if n // h < 4:  # the bias correction divides by 1 - 3 h / T
        nan = np.full(len(x), math.nan)
        none = np.zeros(len(x), dtype=bool)
        return {"mean": x.mean(axis=1), "se": nan, "df": nan, "half": nan, "rho": nan, "lag": lag, "blocks": 0,
                "mde": nan, "mde_df": nan, "clipped": none, "ar1": none, "persistent": none, "has_interval": none}
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
    ar1 = persistent = np.zeros(len(x), dtype=bool)
    if q == 0 and n >= AR1_SPANS[0]:
        a, se1, fit = ar1_interval(dev)
        cv = ar1_critical(a, n)
        # (R,) the df whose t(0.975) is the table's critical value, so p-values and other levels follow the same t
        grid = np.geomspace(1.0, 1e5, 2000)
        d1 = np.interp(-cv, -sps.t.ppf(0.975, grid), grid)
        ar1 = fit & (se1 > 0) & ~clipped
        persistent = ar1 & ~np.isfinite(cv)  # the table never rejects there: no interval, and the reason says why
        rho, se, df = np.where(ar1, a, rho), np.where(ar1, se1, se), np.where(ar1, d1, df)
    # The mde at the smaller df: power averages over the df's own noise, which the larger df understates (AR(1) 0.6,
    # 50 dates: 0.71 of the simulated mde at the larger df, 0.98 at the smaller; docs/evaluation.md).
    mde = np.where(ar1, ar1_mde(rho, se, n, n), (sps.t.ppf(0.5 + level / 2, low) + sps.t.ppf(POWER, low)) * se)
    half = np.where(persistent, np.inf, sps.t.ppf(0.5 + level / 2, df) * se)  # no interval: the whole line
    return {"mean": x.mean(axis=1), "se": se, "df": df, "half": half, "rho": rho,
            "lag": lag, "blocks": blocks, "mde": mde, "mde_df": low, "clipped": clipped, "ar1": ar1,
            "persistent": persistent, "has_interval": (n // h >= MIN_BLOCKS) & (se > 0) & ~persistent}


def ar1_mde(a: np.ndarray, se: np.ndarray, n: int, span: float) -> np.ndarray:
    """The AR(1) branch's mde `(R,)` at `span` dates for series like these (coefficients `a`, se of the mean `se` over
    n dates): (cv(a_m, span) + z_POWER) se_m, with a_m = a + z_POWER s.e. of a at span (power averages over the noise
    of a: at a itself the mde is 0.72 of the simulated one at AR(1) 0.6, 50 dates) and se_m the se at a_m and span;
    inf where cv(a_m, span) is (no power at any size)."""
    a = np.clip(a, -0.9, 0.99)
    am = np.clip(a + sps.norm.ppf(POWER) * np.sqrt((1 - a**2) / span), -0.9, 0.99)
    ratio = (1 + am) / (1 - am) * (1 - a) / (1 + a) * n / span
    return (ar1_critical(am, span) + sps.norm.ppf(POWER)) * se * np.sqrt(ratio)


@cache
def ar1_table() -> np.ndarray:
    """AR1_TABLE's critical values `(len(AR1_SPANS), len(AR1_A))`, checked against the grid it was built on."""
    rows = [line.split(",") for line in AR1_TABLE.read_text(encoding="utf-8").split()]
    if [float(v) for v in rows[0][1:]] != AR1_A.tolist() or [int(r[0]) for r in rows[1:]] != list(AR1_SPANS):
        raise RuntimeError(f"{AR1_TABLE} does not match AR1_SPANS x AR1_A: rebuild it (scripts/simulate_intervals.py)")
    return np.array([[float(v) for v in r[1:]] for r in rows[1:]])


def ar1_critical(a: np.ndarray, n: int) -> np.ndarray:
    """cv(a, n) of AR1_TABLE for coefficients `a (R,)` at span n: the cell of a (the table's cells are where it was
    simulated), linear in log n between spans (clamped); inf (no interval) where a span on either side is."""
    at = np.interp(np.log(n), np.log(AR1_SPANS), np.arange(len(AR1_SPANS)))  # fractional row of the table
    row, col = min(int(at), len(AR1_SPANS) - 2), np.digitize(a, (AR1_A[:-1] + AR1_A[1:]) / 2)
    w, lo, hi = at - row, ar1_table()[row, col], ar1_table()[row + 1, col]
    none = (np.isinf(lo) & (w < 1)) | (np.isinf(hi) & (w > 0))
    return np.where(none, np.inf, (1 - w) * np.minimum(lo, 1e6) + w * np.minimum(hi, 1e6))


def ar1_interval(dev: np.ndarray) -> tuple[np.ndarray, ...]:
    """The AR(1) branch for demeaned rows `dev (R, T)`: (a, se, fit), each `(R,)`: the Kendall-corrected lag-1
    coefficient a + (1 + 3 a) / T clipped to [-0.9, 0.99], the se of the mean s^2 (1 + a) / ((1 - a) T), and whether
    the Ljung-Box test on the residuals (K = 2 + ln T lags, K - 1 df, as statsmodels' acorr_ljungbox with model_df=1)
    passes AR1_FIT_P."""
    n = dev.shape[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.nan_to_num((dev[:, 1:] * dev[:, :-1]).sum(axis=1) / (dev**2).sum(axis=1))
    a = np.clip(a + (1 + 3 * a) / n, -0.9, 0.99)
    se = np.sqrt((dev**2).sum(axis=1) / (n - 1) * (1 + a) / (1 - a) / n)
    e = dev[:, 1:] - a[:, None] * dev[:, :-1]
    e = e - e.mean(axis=1, keepdims=True)
    m, lags = n - 1, 2 + int(math.log(n))
    with np.errstate(divide="ignore", invalid="ignore"):
        acf = np.stack([(e[:, k:] * e[:, :-k]).sum(axis=1) for k in range(1, lags + 1)], 1) / (e**2).sum(1)[:, None]
    lb = m * (m + 2) * (np.nan_to_num(acf) ** 2 / (m - np.arange(1, lags + 1))).sum(axis=1)
    return a, se, sps.chi2.sf(lb, lags - 1) >= AR1_FIT_P


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
    if r["ar1"]:  # the mde at f times the span, for windows_needed: the same rule at a longer span
        mde_at = lambda f: float(ar1_mde(np.array([r["rho"]]), np.array([se]), n_dates, n_dates * f)[0])  # noqa: E731
    else:  # the df grow in proportion to the span
        mde_at = lambda f: (sps.t.ppf(0.5 + level / 2, max(r["mde_df"] * f, 1.0))  # noqa: E731
                            + sps.t.ppf(POWER, max(r["mde_df"] * f, 1.0))) * se / math.sqrt(f)
    needed = windows_needed(mean, mde_at, n_win) if ok and se > 0 else None
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
               else persistent_reason(float(r["rho"]), n_dates) if r["persistent"]
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
                                                  f"{mde:.3g} in size ({POWER:.0%} power)" if math.isfinite(mde) else
                                                  f"contains 0; at this persistence these dates detect no difference "
                                                  f"of any size with {POWER:.0%} power")
            if needed:
                why += f"; about {needed} windows would detect a difference the size of this one"
    out["reason"] = f"{span}: {why}"
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in out.items()}  # strict JSON


def windows_needed(mean: float, mde_at, n_win: int) -> int | None:
    """Windows at which the rule detects a true difference `mean` with POWER: n_win f for the smallest f with
    mde_at(f) <= |mean| (`mde_at(f)`: the rule's mde with f times the span, falling in f); None at mean 0 or beyond
    10^7 windows."""
    if not mean or not mde_at(1e7 / n_win) <= abs(mean):
        return None
    lo, hi = math.log(1e-3), math.log(1e7 / n_win)
    for _ in range(60):  # bisection in log f
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if mde_at(math.exp(mid)) <= abs(mean) else (mid, hi)
    return int(math.ceil(n_win * math.exp(hi)))


def persistent_reason(a: float, n: int) -> str:
    """Why the AR(1) branch gives no interval at lag-1 coefficient `a` over n dates, and how many more would."""
    finite = lambda m: bool(np.isfinite(ar1_critical(np.array([a]), m))[0])  # noqa: E731
    lo, hi, more = n, 10 * AR1_SPANS[-1], None
    if finite(hi):
        while hi - lo > 1:  # bisection: the table's cells of no interval shrink as the span grows
            lo, hi = (lo, (lo + hi) // 2) if finite((lo + hi) // 2) else ((lo + hi) // 2, hi)
        more = hi
    return (f"no 95% interval: the differences are too persistent for {n} dates (lag-1 autocorrelation {a:.2f}, "
            "which a near-unit-root series also shows over so few dates: no interval keeps its 5% error rate there)"
            + (f"; about {more - n} more dates or sessions would give one" if more else ""))
