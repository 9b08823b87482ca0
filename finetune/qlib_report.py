"""Scoring and backtesting signals for the Qlib report: signal analysis against the trade labels, Qlib's
TopkDropoutStrategy backtest with positions and turnover, the short summary table and the plots.

Every number comes from Qlib's own functions where Qlib has one: labels from `D.features` expressions
(finetune/evaluation/qlib_labels.py), IC / RankIC / long-short from `qlib.contrib.eva.alpha`
(finetune/evaluation/signal_analysis.py), returns and drawdowns from `qlib.contrib.evaluate.risk_analysis`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from finetune.evaluation.signal_analysis import analyse_signal, ic_decay

__all__ = ["backtest_period", "plot_cumulative", "risk", "run_backtest", "score_signal", "seed_spread", "summary_table"]


def backtest_period(
    calendar: pd.DatetimeIndex, start: pd.Timestamp, end: pd.Timestamp
) -> tuple[pd.Timestamp, pd.Timestamp]:
    """Trading days [first >= start, last <= end], and before the calendar's last day: Qlib's backtest needs
    the day after its last step (IndexError otherwise)."""
    days = calendar[(calendar >= start) & (calendar <= end)]
    days = days[days < calendar[-1]]
    if len(days) < 2:
        raise ValueError(
            f"data.test_time_range: fewer than 2 trading days to backtest between {start.date()} and {end.date()}"
        )
    return days[0], days[-1]


def run_backtest(cfg, signal: pd.Series, start: pd.Timestamp, end: pd.Timestamp) -> tuple[pd.DataFrame, dict]:
    """Qlib TopkDropoutStrategy on `signal` (index datetime, instrument; the score of day t trades on t+1).

    Returns
    -------
    (daily report with columns return, cost, bench, turnover, account; {day: sorted stocks held at its close}).
    """
    from qlib.backtest import backtest, executor
    from qlib.contrib.strategy import TopkDropoutStrategy

    b = cfg.backtest
    strategy = TopkDropoutStrategy(topk=b.topk, n_drop=b.n_drop, hold_thresh=b.hold_thresh, signal=signal)
    ex = executor.SimulatorExecutor(time_per_step=cfg.data.freq, generate_portfolio_metrics=True, verbose=False)
    exchange = {"freq": cfg.data.freq, "limit_threshold": b.limit_threshold, "deal_price": b.deal_price,
                "open_cost": b.open_cost, "close_cost": b.close_cost, "min_cost": b.min_cost}
    with warnings.catch_warnings():
        # Qlib averages an empty order list on days the strategy only holds ("Mean of empty slice"): harmless.
        warnings.simplefilter("ignore", RuntimeWarning)
        metrics, _ = backtest(start_time=start, end_time=end, strategy=strategy, executor=ex, account=b.account,
                              benchmark=cfg.benchmark, exchange_kwargs=exchange)
    report, positions = next(iter(metrics.values()))
    return report, {pd.Timestamp(day): sorted(pos.get_stock_list()) for day, pos in positions.items()}


def risk(returns: pd.Series, freq: str) -> dict[str, float]:
    """Qlib's risk analysis (mean, std, annualized_return, information_ratio, max_drawdown) as a dict."""
    from qlib.contrib.evaluate import risk_analysis

    table = risk_analysis(returns, freq=freq)
    return {k: float(v) for k, v in table["risk"].items()}


def score_signal(cfg, pred: pd.Series, labels: pd.DataFrame, horizon: int, start: pd.Timestamp, end: pd.Timestamp,
                 backtest: bool = True) -> tuple[dict, pd.DataFrame | None]:
    """Signal analysis at every horizon, the headline at `horizon`, and the backtest of one signal.

    Parameters
    ----------
    pred : scores indexed by (datetime, instrument); labels : label_1..label_P (trade labels); horizon : the one the
    signal forecasts; start, end : backtest days.

    Returns
    -------
    ({"horizon", "analysis" (per label), "decay" (table as dict), "headline": {IC, RankIC, ICIR, RankICIR, IC_t_nw,
    long_short}, "backtest": {excess_return_with_cost, ..., turnover_mean, holdings_mean}}, daily frame with columns
    return, cost, bench, turnover, held or None).
    """
    pred = pred.dropna()
    analysis = analyse_signal(pred, labels, quantile=cfg.backtest.quantile)
    head = analysis[f"label_{horizon}"]
    out = {"horizon": horizon, "analysis": analysis, "decay": ic_decay(analysis).to_dict(orient="index"),
           "headline": {"IC": head["ic"]["mean"], "ICIR": head["ic"]["icir"], "IC_t_nw": head["ic"]["t_nw"],
                        "RankIC": head["rank_ic"]["mean"], "RankICIR": head["rank_ic"]["icir"],
                        "long_short": head["long_short"]["mean"], "days": head["days"]}}
    if not backtest:
        return out, None
    report, holdings = run_backtest(cfg, pred.sort_index(), start, end)
    held = pd.Series({d: len(v) for d, v in holdings.items()}, dtype=int).reindex(report.index).fillna(0).astype(int)
    excess = report["return"] - report["bench"]
    freq = cfg.data.freq
    out["backtest"] = {
        "benchmark": risk(report["bench"], freq),
        "excess_return_without_cost": risk(excess, freq),
        "excess_return_with_cost": risk(excess - report["cost"], freq),
        "turnover_mean": float(report["turnover"].mean()),
        "holdings_mean": float(held.mean()),
        "first_day_turnover": float(report["turnover"].iloc[0]),
    }
    daily = report[["return", "cost", "bench", "turnover"]].assign(
        held=held, positions=[" ".join(holdings.get(d, [])) for d in report.index])
    return out, daily


def summary_table(results: dict[str, dict]) -> pd.DataFrame:
    """signal x {h, days, IC, t(IC) (Newey-West, lag h-1: overlapping h-day labels), RankIC, ICIR, excess ann.
    (with cost), information ratio of the excess, max drawdown}; one row per signal and seed (the spread over seeds
    goes to report.json)."""
    rows = {}
    for name, r in results.items():
        bt = r.get("backtest", {}).get("excess_return_with_cost", {})
        head = r["headline"]
        rows[name] = {"h": r["horizon"], "days": head.get("days", math.nan), "IC": head["IC"],
                      "t_IC": head.get("IC_t_nw", math.nan), "RankIC": head["RankIC"], "ICIR": head["ICIR"],
                      "excess_ann": bt.get("annualized_return", math.nan),
                      "IR": bt.get("information_ratio", math.nan), "max_dd": bt.get("max_drawdown", math.nan)}
    return pd.DataFrame.from_dict(rows, orient="index")


def plot_cumulative(daily: dict[str, pd.DataFrame], benchmark: str, path: Path) -> None:
    """Cumulative return with cost per signal vs the benchmark, and cumulative excess return with cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    bench = None
    for name, frame in daily.items():
        net = frame["return"] - frame["cost"]
        style = "--" if name in ("momentum", "reversal") or name.startswith("zeroshot") else "-"
        top.plot(frame.index, net.cumsum(), style, label=name)
        bottom.plot(frame.index, (net - frame["bench"]).cumsum(), style, label=name)
        bench = frame["bench"]
    if bench is not None:
        top.plot(bench.index, bench.cumsum(), "k:", label=benchmark)
    top.set(title="Cumulative return with cost", ylabel="cumulative return")
    bottom.set(title="Cumulative excess return with cost", ylabel="cumulative excess return", xlabel="date")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def seed_spread(per_seed: list[dict]) -> dict:
    """Mean and std (ddof=1) over seeds of the headline IC / RankIC and the annualised excess return with cost."""
    def stats(values: list[float]) -> dict[str, float]:
        v = np.asarray(values, dtype=np.float64)
        return {"mean": float(np.nanmean(v)) if np.isfinite(v).any() else math.nan,
                "std": float(np.nanstd(v, ddof=1)) if np.isfinite(v).sum() > 1 else math.nan}

    return {"seeds": len(per_seed),
            "IC": stats([r["headline"]["IC"] for r in per_seed]),
            "RankIC": stats([r["headline"]["RankIC"] for r in per_seed]),
            "excess_return_with_cost_ann": stats([r.get("backtest", {}).get("excess_return_with_cost", {})
                                                  .get("annualized_return", math.nan) for r in per_seed])}
