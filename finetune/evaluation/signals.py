"""Forward-return labels that follow the trade (a score dated t trades on day t+1: price(t+1+h) / price(t+1) - 1),
computed by Qlib on the market calendar. Why, and the gaps rule: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from finetune.evaluation.statistics import mean_test
from finetune.utils.plots import pyplot, save_figure
from model.errors import DataError

DEAL_PRICES = ("close", "open", "vwap")


def label_expression(deal_price: str = "close", horizon: int = 1) -> str:
    """Qlib expression of the `horizon`-day (>= 1) return of a position entered at t+1 at `deal_price` ("close",
    "open" or "vwap"; a leading "$" is accepted), e.g. "Ref($close, -2) / Ref($close, -1) - 1" for close, h = 1."""
    if not isinstance(horizon, int) or horizon < 1:
        raise DataError(f"horizon={horizon!r} must be an integer >= 1")
    name = deal_price.lstrip("$").lower()
    if name not in DEAL_PRICES:
        raise DataError(f"deal_price={deal_price!r} is not supported; choose one of {list(DEAL_PRICES)} "
                        "(backtest.deal_price)")
    field = f"${name}"
    return f"Ref({field}, -{horizon + 1}) / Ref({field}, -1) - 1"


def forward_labels(instruments, start_time, end_time, deal_price: str = "close",
                   horizons: int | Sequence[int] = 1, freq: str = "day") -> pd.DataFrame:
    """Trade-consistent forward returns of `instruments` (a market name such as "csi300", a Qlib instruments config
    or a list of symbols) from the initialised Qlib provider: index (datetime, instrument) over the label dates
    `start_time`..`end_time` (Qlib reads the later days the expressions need by itself), columns label_<h> for
    `horizons` (P -> 1..P, or a list); NaN where a needed day is missing, suspended or beyond the store's end."""
    hs = list(range(1, horizons + 1)) if isinstance(horizons, int) else [int(h) for h in horizons]
    if not hs or min(hs) < 1:
        raise DataError(f"horizons={horizons!r}: need at least one horizon, each >= 1")
    exprs = {f"label_{h}": label_expression(deal_price, h) for h in hs}
    return _qlib_features(instruments, exprs, start_time, end_time, freq)


def _qlib_features(instruments, exprs: dict[str, str], start_time, end_time, freq: str) -> pd.DataFrame:
    """{column: Qlib expression} of `instruments` (market name, instruments config or list of symbols) from the
    initialised Qlib provider, as a frame indexed by (datetime, instrument)."""
    from qlib.data import D  # Qlib only where it is used; the package itself does not need it

    if isinstance(instruments, str):
        instruments = D.instruments(instruments)
    frame = D.features(instruments, list(exprs.values()), start_time=start_time, end_time=end_time, freq=freq)
    frame.columns = list(exprs)
    return frame.swaplevel().sort_index() if frame.index.names[0] == "instrument" else frame.sort_index()


def _aligned(pred: pd.Series, label: pd.Series) -> tuple[pd.Series, pd.Series]:
    """pred and label on their common (datetime, instrument) rows where both are finite."""
    if list(pred.index.names) != ["datetime", "instrument"]:
        raise DataError(f"pred must be indexed by (datetime, instrument), got {list(pred.index.names)}")
    frame = pd.DataFrame({"pred": pred, "label": label}).dropna()
    return frame["pred"], frame["label"]


def daily_ic(pred: pd.Series, label: pd.Series) -> tuple[pd.Series, pd.Series]:
    """Daily IC and RankIC (Qlib's `calc_ic`) of `pred` against one label column, on the rows where both are
    finite; two Series indexed by day, in time order, days without a defined correlation dropped."""
    from qlib.contrib.eva.alpha import calc_ic

    ic, ric = calc_ic(*_aligned(pred, label))
    return ic.dropna().sort_index(), ric.dropna().sort_index()


def quantile_group_returns(pred: pd.Series, label: pd.Series, n_groups: int = 5) -> pd.DataFrame:
    """Mean label per day of each score group: a (days, n_groups) DataFrame, columns 1 (lowest scores) ..
    `n_groups`; stocks are ranked each day (ties by order) and cut into groups of (nearly) equal size."""
    pred, label = _aligned(pred, label)
    rank = pred.groupby(level="datetime").rank(method="first")  # 1..n per day
    count = pred.groupby(level="datetime").transform("size")
    group = ((rank - 1) * n_groups // count).astype(int) + 1
    table = label.groupby([label.index.get_level_values("datetime"), group.to_numpy()]).mean().unstack()
    table.index.name, table.columns.name = "datetime", "group"
    return table


def _long_excess(pred: pd.Series, label: pd.Series, quantile: float) -> pd.Series:
    """Per day: mean label of the top int(n * quantile) scores minus the mean label of all (calc_long_short's legs)."""
    by_day = pred.groupby(level="datetime")
    rank = by_day.rank(method="first", ascending=False)  # 1 = highest score
    n_long = (by_day.transform("size") * quantile).astype(int)
    long_mean = label[rank <= n_long].groupby(level="datetime").mean()
    return (long_mean - label.groupby(level="datetime").mean()).dropna()


def analyse_signal(pred: pd.Series, labels: pd.DataFrame, quantile: float = 0.2, n_groups: int = 5) -> dict:
    """IC, RankIC, long-short (`quantile` of the stocks in each leg), long excess and `n_groups` quantile-group
    returns of `pred` (indexed by (datetime, instrument)) for every label_<h> column of `labels`:
    {"label_<h>": {"horizon", "days", "ic": {mean, std, icir, t}, "rank_ic": {...}, "long_short": {mean, t},
    "long_average": {mean}, "excess_return": {mean, t}, "group_means": [n_groups means]}}; returns are h-day
    returns per day of the score (not annualised); t is `statistics.mean_test`'s (lag h - 1, normal scale, NaN where
    the interval rule claims no interval)."""
    from qlib.contrib.eva.alpha import calc_ic, calc_long_short_return

    out = {}
    for col in labels.columns:
        horizon = int(str(col).rsplit("_", 1)[-1]) if str(col).rsplit("_", 1)[-1].isdigit() else 1
        p, y = _aligned(pred, labels[col])
        if len(p) == 0:
            raise DataError(f"no day with both a score and a finite {col}; check the score dates against the store")
        ic, ric = calc_ic(p, y)
        ls, avg = calc_long_short_return(p, y, quantile=quantile)
        excess = _long_excess(p, y, quantile)
        groups = quantile_group_returns(p, y, n_groups).mean()
        out[str(col)] = {"horizon": horizon, "days": int(ic.notna().sum()), "ic": _ic_stats(ic, horizon),
                         "rank_ic": _ic_stats(ric, horizon), "long_short": _mean_t(ls, horizon),
                         "long_average": {"mean": float(avg.mean())}, "excess_return": _mean_t(excess, horizon),
                         "group_means": [float(groups.get(g, math.nan)) for g in range(1, n_groups + 1)]}
    return out


def _ic_stats(ic: pd.Series, horizon: int) -> dict[str, float]:
    """mean, std, ICIR = mean / std (as Qlib's SigAnaRecord) and `mean_test`'s t with lag h - 1."""
    ic = ic.dropna().sort_index()
    std = float(ic.std()) if len(ic) > 1 else math.nan
    return {**_mean_t(ic, horizon), "std": std, "icir": float(ic.mean()) / std if std > 0 else math.nan}


def _mean_t(r: pd.Series, horizon: int) -> dict[str, float]:
    r = r.dropna().sort_index()
    return {"mean": float(r.mean()), "t": mean_test(r.to_numpy(), horizon - 1)["t"]}


def ic_decay(analysis: dict) -> pd.DataFrame:
    """Table (horizons, [ic, rank_ic, ic_t, long_short]) from an `analyse_signal` result, by horizon."""
    rows = {v["horizon"]: {"ic": v["ic"]["mean"], "rank_ic": v["rank_ic"]["mean"], "ic_t": v["ic"]["t"],
                           "long_short": v["long_short"]["mean"]} for v in analysis.values()}
    table = pd.DataFrame.from_dict(rows, orient="index").sort_index()
    table.index.name = "horizon"
    return table


def plot_ic_decay(tables: dict[str, pd.DataFrame], path: str | Path) -> Path:
    """PNG of IC (left) and RankIC (right) against the integer horizon, one line per signal ({name: `ic_decay`
    table}): one colour per signal kind (last, mean, ...), dashed for zero-shot, dotted for the baselines; the legend
    sits outside the axes."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    horizons = sorted({int(h) for t in tables.values() for h in t.index})
    kinds = list(dict.fromkeys(name.split("@")[0] for name in tables))
    for name, table in tables.items():
        kind = name.split("@")[0]
        style = "--" if "zeroshot" in name else ":" if kind in ("momentum", "reversal") else "-"
        colour = plt.get_cmap("tab10")(kinds.index(kind) % 10)
        for ax, col in zip(axes, ("ic", "rank_ic")):
            ax.plot(table.index, table[col], style, marker="o", ms=4, color=colour,
                    label=name if ax is axes[0] else None)
    for ax, title in zip(axes, ("IC", "RankIC")):
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xticks(horizons)
        ax.grid(True, alpha=0.3)
        ax.set(xlabel="horizon h (days held from t+1)", title=f"mean daily {title} by horizon")
    axes[0].set_ylabel("mean daily correlation")
    fig.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    return save_figure(fig, path, dpi=100, bbox_inches="tight")


@dataclass
class BaselineSettings:
    """Look-back windows of the baseline signals, in trading days."""

    momentum_window: int = 20  # Momentum: return over this many days.
    reversal_window: int = 5  # Short-term reversal: minus the return over this many days.


def baseline_expressions(settings: BaselineSettings | None = None) -> dict[str, str]:
    """{signal name: Qlib expression}; the expressions step along the stored calendar (NaN across a suspension)."""
    s = settings or BaselineSettings()
    for key in ("momentum_window", "reversal_window"):
        value = getattr(s, key)
        if not isinstance(value, int) or value < 1:
            raise DataError(f"{key}={value!r} must be an integer >= 1")
    return {"momentum": f"$close / Ref($close, {s.momentum_window}) - 1",
            "reversal": f"Ref($close, {s.reversal_window}) / $close - 1"}


def baseline_signals(instruments, start_time, end_time, settings: BaselineSettings | None = None,
                     freq: str = "day") -> pd.DataFrame:
    """Baseline scores (columns momentum, reversal; index (datetime, instrument)) of `instruments` (market name,
    Qlib instruments config or list of symbols) on the score dates `start_time`..`end_time`, from the initialised
    Qlib provider (it reads the look-back days before `start_time` by itself)."""
    return _qlib_features(instruments, baseline_expressions(settings), start_time, end_time, freq)
