"""Scoring and backtesting signals for the Qlib report: signal analysis against the trade labels, Qlib's
TopkDropoutStrategy backtest with positions and turnover, the short summary table and the plots.

Every number comes from Qlib's own functions where Qlib has one: labels from `D.features` expressions
(finetune/evaluation/signals.py), IC / RankIC / long-short from `qlib.contrib.eva.alpha`
(finetune/evaluation/signals.py), returns and drawdowns from `qlib.contrib.evaluate.risk_analysis`."""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import io
import logging
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from finetune.config import QlibConfig, check_model_folder, cli_parser, load
from finetune.dataset import check_processed, load_split, read_manifest, split_path
from finetune.evaluation.report import write_report
from finetune.evaluation.signals import (
    BaselineSettings,
    analyse_signal,
    baseline_signals,
    daily_ic,
    forward_labels,
    ic_decay,
    plot_ic_decay,
)
from finetune.evaluation.statistics import paired_test
from finetune.qlib_data_preprocess import first_signal_day
from finetune.qlib_forecast import Forecaster, forecast_frame, forecast_window_ends, kronos_forecaster, signal_horizon
from finetune.qlib_io import benchmark_label, check_qlib_folder, init_qlib, range_bounds, read_calendar
from finetune.utils.cli_args import parse_config_args
from finetune.utils.config_utils import config_to_dict
from finetune.utils.errors import require_extra, setup_logging
from finetune.utils.plots import pyplot, save_figure
from finetune.utils.safety import RunLock
from finetune.utils.store import SeriesPanel
from model.errors import DataError
from model.fileio import atomic_dir, write_json
from model.predictor import default_device, load_pretrained_pair, load_trained_pair


def backtest_period(calendar: pd.DatetimeIndex, start: pd.Timestamp,
                    end: pd.Timestamp) -> tuple[pd.Timestamp, pd.Timestamp]:
    """Trading days [first >= start, last <= end], and before the calendar's last day: Qlib's backtest needs
    the day after its last step (IndexError otherwise)."""
    days = calendar[(calendar >= start) & (calendar <= end)]
    days = days[days < calendar[-1]]
    if len(days) < 2:
        raise DataError(f"data.test_time_range: fewer than 2 trading days to backtest between {start.date()} and "
                        f"{end.date()}")
    return days[0], days[-1]


def data_ends(instruments, end: pd.Timestamp) -> dict[str, pd.Timestamp]:
    """{code: last day of its data} for each of `instruments` whose data (instruments/all.txt) ends before `end`."""
    from qlib.data import D

    spans = D.list_instruments(D.instruments("all"), as_list=False)
    last = {str(c): max(pd.Timestamp(b) for _, b in v) for c, v in spans.items() if v}
    return {c: last[c] for c in sorted(map(str, instruments)) if c in last and last[c] < pd.Timestamp(end)}


def run_backtest(cfg, signal: pd.Series, start: pd.Timestamp, end: pd.Timestamp) -> tuple[pd.DataFrame, dict]:
    """Qlib TopkDropoutStrategy on `signal` (index datetime, instrument; the score of day t trades on t+1).

    An instrument whose data ends before `end` is sold on its last bar and never bought on or after it: Qlib's
    exchange treats every later day as suspended, so the position would otherwise stay held, frozen, to the end.
    Returns (daily report: return, cost, bench, turnover, account; {day: sorted stocks held at its close})."""
    with quiet_qlib():
        from qlib.backtest import backtest, executor
        from qlib.backtest.decision import Order, OrderDir, TradeDecisionWO
        from qlib.contrib.strategy import TopkDropoutStrategy

    ends = data_ends(signal.index.get_level_values("instrument").unique(), end)

    class ClosingTopkDropout(TopkDropoutStrategy):
        def generate_trade_decision(self, execute_result=None):
            decision = super().generate_trade_decision(execute_result)
            t0, t1 = self.trade_calendar.get_step_time(self.trade_calendar.get_trade_step())
            gone = {c for c, last in ends.items() if last <= pd.Timestamp(t0).normalize()}
            if not gone:
                return decision
            orders = [o for o in decision.get_decision() if not (o.stock_id in gone and o.direction == Order.BUY)]
            selling = {o.stock_id for o in orders if o.direction == Order.SELL}
            closing = [Order(stock_id=c, amount=self.trade_position.get_stock_amount(c), start_time=t0, end_time=t1,
                             direction=Order.SELL)
                       for c in self.trade_position.get_stock_list() if c in gone and c not in selling
                       and self.trade_exchange.is_stock_tradable(c, t0, t1, direction=OrderDir.SELL)]
            return TradeDecisionWO(closing + orders, self)

    b = cfg.backtest
    strategy = ClosingTopkDropout(topk=b.topk, n_drop=b.n_drop, hold_thresh=b.hold_thresh, signal=signal)
    exchange = {"freq": cfg.data.freq, "limit_threshold": b.limit_threshold, "deal_price": b.deal_price,
                "open_cost": b.open_cost, "close_cost": b.close_cost, "min_cost": b.min_cost}
    with quiet_qlib():
        ex = executor.SimulatorExecutor(time_per_step=cfg.data.freq, generate_portfolio_metrics=True, verbose=False)
        metrics, _ = backtest(start_time=start, end_time=end, strategy=strategy, executor=ex, account=b.account,
                              benchmark=cfg.benchmark, exchange_kwargs=exchange)
    report, positions = next(iter(metrics.values()))
    return report, {pd.Timestamp(day): sorted(pos.get_stock_list()) for day, pos in positions.items()}


@contextlib.contextmanager
def quiet_qlib() -> Iterator[None]:
    """Qlib's backtest without its noise: no progress bar, no Gym notice at import, none of the warnings it raises
    on every run (numpy's "Mean of empty slice" on days the strategy only holds, deprecation notices, its calendar
    and executor set-up warnings); Qlib's errors still show."""
    import importlib

    with contextlib.redirect_stderr(io.StringIO()):  # gym (imported by qlib.rl) prints a notice on import
        qlib_backtest = importlib.import_module("qlib.backtest.backtest")
        importlib.import_module("qlib.contrib.strategy")
    from tqdm.auto import tqdm

    def errors_only(record: logging.LogRecord) -> bool:
        return not record.name.startswith("qlib") or record.levelno >= logging.ERROR

    handlers = logging.getLogger("qlib").handlers + logging.getLogger().handlers
    bar = qlib_backtest.tqdm
    qlib_backtest.tqdm = functools.partial(tqdm, disable=True)
    for h in handlers:
        h.addFilter(errors_only)
    try:
        with warnings.catch_warnings():
            for category in (RuntimeWarning, DeprecationWarning, FutureWarning, PendingDeprecationWarning):
                warnings.simplefilter("ignore", category)
            yield
    finally:
        qlib_backtest.tqdm = bar
        for h in handlers:
            h.removeFilter(errors_only)


def risk(returns: pd.Series, freq: str) -> dict[str, float]:
    """Qlib's risk analysis (mean, std, annualized_return, information_ratio, max_drawdown) as a dict."""
    from qlib.contrib.evaluate import risk_analysis

    table = risk_analysis(returns, freq=freq)
    return {k: float(v) for k, v in table["risk"].items()}


def score_signal(cfg, pred: pd.Series, labels: pd.DataFrame, horizon: int, start: pd.Timestamp,
                 end: pd.Timestamp) -> tuple[dict, pd.DataFrame]:
    """Analysis of `pred` against every trade label (label_1..label_P), the headline at `horizon` (the one the
    signal forecasts) and the backtest over start..end: ({"horizon", "analysis" (per label), "decay", "headline":
    {IC, RankIC, ICIR, RankICIR, IC_t, long_short}, "backtest": {excess_return_with_cost, ..., turnover_mean,
    holdings_mean}}, daily frame with columns return, cost, bench, turnover, held)."""
    pred = pred.dropna()
    analysis = analyse_signal(pred, labels, quantile=cfg.backtest.quantile)
    head = analysis[f"label_{horizon}"]
    out = {"horizon": horizon, "analysis": analysis, "decay": ic_decay(analysis).to_dict(orient="index"),
           "headline": {"IC": head["ic"]["mean"], "ICIR": head["ic"]["icir"], "IC_t": head["ic"]["t"],
                        "RankIC": head["rank_ic"]["mean"], "RankICIR": head["rank_ic"]["icir"],
                        "long_short": head["long_short"]["mean"], "days": head["days"]}}
    report, holdings = run_backtest(cfg, pred.sort_index(), start, end)
    held = pd.Series({d: len(v) for d, v in holdings.items()}, dtype=int).reindex(report.index).fillna(0).astype(int)
    excess = report["return"] - report["bench"]
    freq = cfg.data.freq
    out["backtest"] = {
        "benchmark": risk(report["bench"], freq),
        "excess_return_without_cost": risk(excess, freq),
        "excess_return_with_cost": risk(excess - report["cost"], freq),
        "turnover_mean": float(report["turnover"].mean()),
        "cost_ann": risk(report["cost"], freq)["annualized_return"],
        "holdings_mean": float(held.mean()),
        "first_day_turnover": float(report["turnover"].iloc[0]),
    }
    daily = report[["return", "cost", "bench", "turnover"]].assign(
        held=held, positions=[" ".join(holdings.get(d, [])) for d in report.index])
    return out, daily


def summary_table(results: dict[str, dict], t_ok: bool = True) -> pd.DataFrame:
    """signal x {h, days, IC, t(IC) (`statistics.mean_test`, lag h-1: overlapping h-day labels; NaN unless `t_ok` and
    where the interval rule claims no interval), RankIC,
    ICIR, excess ann. (with cost), information ratio of the excess, max drawdown, mean daily turnover, annualised
    cost}; one row per signal and seed (the spread over seeds goes to report.json)."""
    rows = {}
    for name, r in results.items():
        bt = r.get("backtest", {})
        ex, head = bt.get("excess_return_with_cost", {}), r["headline"]
        rows[name] = {"h": r["horizon"], "days": head.get("days", math.nan), "IC": head["IC"],
                      "t_IC": head.get("IC_t", math.nan) if t_ok else math.nan, "RankIC": head["RankIC"],
                      "ICIR": head["ICIR"], "excess_ann": ex.get("annualized_return", math.nan),
                      "IR": ex.get("information_ratio", math.nan), "max_dd": ex.get("max_drawdown", math.nan),
                      "turnover": bt.get("turnover_mean", math.nan), "cost_ann": bt.get("cost_ann", math.nan)}
    return pd.DataFrame.from_dict(rows, orient="index")


def best_signal(signals: dict[str, pd.Series], labels: pd.DataFrame, results: dict[str, dict],
                baselines: list[str]) -> dict:
    """Every signal ranked by mean daily IC at one label horizon h (the longest any signal forecasts, so a Kronos
    signal and the baselines answer the same question), seeds of one model as one entry (their daily IC averaged:
    "last@seed0", "last@seed1" -> "last"), over the days every entry has; the best's `paired_test` (higher is better,
    lag h - 1) of its daily IC minus the runner-up's; `line` for the console."""
    h = max(r["horizon"] for r in results.values())
    entries: dict[str, list[str]] = {}
    for name in [n for n, r in results.items() if np.isfinite(r["headline"]["IC"])]:
        entries.setdefault(name.split("@seed")[0], []).append(name)
    if len(entries) < 2:  # nothing to compare (e.g. every IC undefined on a tiny universe)
        return {"signal": next(iter(entries), None), "horizon": h, "ranking": {},
                "line": "best by IC: fewer than 2 signals with a defined IC, no ranking"}
    daily = pd.DataFrame({e: pd.concat([daily_ic(signals[m], labels[f"label_{h}"])[0] for m in members], axis=1)
                          .mean(axis=1) for e, members in entries.items()}).dropna()  # (days, entries)
    ic = daily.mean().sort_values(ascending=False)  # (entries,)
    best, rival = ic.index[0], ic.index[1]
    diff = daily[best] - daily[rival]  # (days,)
    test = paired_test(diff.to_numpy(), diff.index, h - 1, higher_is_better=True, what=f"daily IC {best} - {rival}")
    advice = f"; the {best} baseline beats every model here: use it, or finetune more" if best in baselines else ""
    seeds = {e: len(m) for e, m in entries.items() if len(m) > 1}
    return {"signal": best, "horizon": h, "ranking": ic.to_dict(), "runner_up": rival, "test": test, "seeds": seeds,
            "line": f"best by IC at h={h}: {best} (" + " > ".join(f"{n} {v:+.4f}" for n, v in ic.items())
            + (f"; seeds averaged: {seeds}" if seeds else "") + f"); against {rival}: {test['reason']}{advice}"}


def plot_cumulative(daily: dict[str, pd.DataFrame], benchmark: str, path: Path) -> Path:
    """Cumulative return with cost per signal vs the benchmark, and cumulative excess return with cost. One colour
    per signal kind (last, mean, ..., momentum); the finetuned seeds are thin lines of that colour, zero-shot is
    dashed, baselines dotted; the legend sits outside the axes."""
    plt = pyplot()
    kinds = list(dict.fromkeys(name.split("@")[0] for name in daily))
    colour = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(kinds)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    labelled, bench = set(), None
    for name, frame in daily.items():
        kind, _, who = name.partition("@")
        group = ("zero-shot" if who == "zeroshot" else "baseline" if kind in ("momentum", "reversal")
                 else "finetuned" + (" (one line per seed)" if who.startswith("seed") else ""))
        style = {"zero-shot": "--", "baseline": ":"}.get(group, "-")
        label = f"{kind} {group}" if (kind, group) not in labelled else None
        labelled.add((kind, group))
        width = 0.9 if who.startswith("seed") else 1.6
        net = frame["return"] - frame["cost"]
        top.plot(frame.index, net.cumsum(), style, color=colour[kind], lw=width, label=label)
        bottom.plot(frame.index, (net - frame["bench"]).cumsum(), style, color=colour[kind], lw=width)
        bench = frame["bench"]
    if bench is not None:
        top.plot(bench.index, bench.cumsum(), "k-", lw=2.2, alpha=0.6, label=f"benchmark {benchmark}")
        period = f"{bench.index[0]:%Y-%m-%d}..{bench.index[-1]:%Y-%m-%d}"
        top.set_title(f"Cumulative return with cost, {period}")
    top.set(ylabel="cumulative return")
    bottom.set(title="Cumulative excess return over the benchmark, with cost", ylabel="cumulative excess return")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.autofmt_xdate()
    fig.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    return save_figure(fig, path, dpi=110, bbox_inches="tight")


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


log = logging.getLogger("finetune.qlib")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli_parser(__doc__)
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu, ... (default: cuda if available, else cpu)")
    return parse_config_args(parser, argv)


def check_inputs(cfg: QlibConfig) -> None:
    """Every settings and input problem of the backtest, raised as one ConfigError before any model is run."""
    problems = cfg.problems()
    check_processed(cfg, ("test",), problems)
    check_model_folder(cfg.paths.finetuned_tokenizer_path, "paths.finetuned_tokenizer_path", problems, hub_ok=False)
    check_model_folder(cfg.paths.finetuned_predictor_path, "paths.finetuned_predictor_path", problems, hub_ok=False)
    check_qlib_folder(cfg, problems)
    out = Path(cfg.paths.backtest_result_path).expanduser()  # replaced whole (`publish`): never a folder of yours
    problems.check(not out.is_dir() or not any(out.iterdir()) or (out / "report.json").is_file(),
                   "paths.backtest_result_path", f"{out} holds files that no backtest wrote (no report.json) and a "
                   "backtest replaces the whole folder; choose a new or empty folder")
    problems.raise_if_any()


def write_results(folder: str | Path, files: dict[str, Any]) -> Path:
    """Write {name: DataFrame | dict | callback(path)} into `folder`, all or nothing (temporary folder first);
    dicts are written as strict JSON (NaN -> null)."""
    folder = Path(folder).expanduser()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, content in files.items():
            target = tmp / name
            if isinstance(content, pd.DataFrame):
                content.to_csv(target, index=content.index.name is not None)
            elif isinstance(content, dict):
                write_json(target, content)
            else:
                content(target)
        folder.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def publish(folder: Path, report: dict, files: dict[str, Any]) -> Path:
    """The backtest's files and page swapped into `folder` whole and sealed (SHA256SUMS, as a forecast folder): no
    reader sees one run's file beside another's, and `kronos report` refuses an edited one."""
    with atomic_dir(folder, sealed=True) as tmp:
        write_results(tmp, {"report.json": report, **files})
        write_report(tmp, shown=folder)
    return folder


def zero_shot_models(cfg: QlibConfig) -> tuple[Any, Any] | None:
    """(tokenizer, predictor) of model.pretrained_* when both are configured and loadable; None (with a logged line
    saying why) otherwise, e.g. a Hub id that cannot be fetched offline."""
    tok, pred = cfg.model.pretrained_tokenizer, cfg.model.pretrained_predictor
    if not tok or not pred:
        log.info("zero-shot baseline skipped: model.pretrained_tokenizer / pretrained_predictor not both configured")
        return None
    try:
        return load_pretrained_pair(pred, tok)[::-1]  # (tokenizer, predictor), as kronos_forecaster takes them
    except Exception as e:  # noqa: BLE001  (an unreachable hub or a bad folder only drops this baseline)
        log.warning("zero-shot baseline skipped: cannot load %s / %s (%s)", tok, pred, str(e).splitlines()[0][:200])
        return None


def forecast_all(cfg: QlibConfig, forecasters: dict[str, Forecaster], seeds: dict[str, int] | None,
                 split: SeriesPanel, calendar_ns: np.ndarray, first_day: pd.Timestamp) -> dict[str, pd.DataFrame]:
    """{name: signals (last, mean, max, min) indexed by (datetime, instrument)} of every forecaster on every
    forecast day from `first_day` to the end of the test range, each seeded right before it runs with
    `seeds[name]` (default forecast.seed): its draws are the same whichever forecasters run before it."""
    d, f = cfg.data, cfg.forecast
    _, end = range_bounds(d.test_time_range)
    ends = forecast_window_ends(split, pd.Timestamp(first_day).value, end.value, d.lookback)
    if len(ends) == 0:
        raise DataError(f"data.test_time_range: no instrument has {d.lookback} bars before a day of the test range")
    frames = {}
    for name, forecaster in forecasters.items():
        seed = (seeds or {}).get(name, f.seed)
        log.info("forecasting the test split (%s, seed %d): %d series", name, seed, split.n_series)
        frames[name] = forecast_frame(split, ends, calendar_ns, forecaster, lookback=d.lookback, predict=d.predict,
                                      freq=d.freq, batch=max(1, f.batch_size // f.sample_count),
                                      seed=seed).set_index(["datetime", "instrument"])
    return frames


def universe_warnings(index: pd.MultiIndex, ends: dict[str, pd.Timestamp]) -> list[str]:
    """Log and return what makes the report less than it seems: too few stocks per day for a cross-sectional IC,
    and instruments whose data ends inside the test range (their positions are closed on the last bar)."""
    out = []
    per_day = float(index.get_level_values("datetime").value_counts().median())
    if per_day < MIN_CROSS_SECTION:
        out.append(f"only {per_day:g} instruments per forecast day (median): a daily cross-sectional IC over so few is "
                   f"mostly noise" + (" and no t-statistic is reported" if per_day < MIN_T_CROSS_SECTION else "")
                   + f"; use a universe of {MIN_CROSS_SECTION}+ stocks (data.instrument)")
    if ends:
        shown = ", ".join(f"{c} ({t.date()})" for c, t in list(ends.items())[:10])
        out.append(f"{len(ends)} instrument(s) have no data after a day inside the backtest; positions in them are "
                   f"sold on their last bar: {shown}{' ...' if len(ends) > 10 else ''}")
    for w in out:
        log.warning("warning: %s", w)
    return out


MIN_CROSS_SECTION = 10  # stocks per day below which a daily cross-sectional IC is mostly noise
MIN_T_CROSS_SECTION = 5  # below this, no t-statistic of the IC is reported at all


def evaluate(cfg: QlibConfig, forecasters: dict[str, Forecaster], split: SeriesPanel, calendar_ns: np.ndarray,
             calendar: pd.DatetimeIndex, seeds: dict[str, int] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Forecast with every named forecaster ("seed0", "seed1", ..., "zeroshot"; each seeded with `seeds[name]`,
    default forecast.seed), add the baselines, score and backtest everything over the same days. Qlib must be
    initialised. Returns (report dict, files to write)."""
    d, b = cfg.data, cfg.backtest
    start, end = range_bounds(d.test_time_range)
    first_day = first_signal_day(calendar, start)
    bt_start, bt_end = backtest_period(calendar, start, end)

    frames = forecast_all(cfg, forecasters, seeds, split, calendar_ns, first_day)
    index = next(iter(frames.values())).index  # member stocks x forecast days (the same for every forecaster)
    instruments = sorted(set(index.get_level_values("instrument")))
    warnings_ = universe_warnings(index, data_ends(instruments, bt_end))
    labels = forward_labels(instruments, first_day, end, deal_price=b.deal_price, horizons=d.predict, freq=d.freq)
    labels = labels.reindex(index)

    signals = {s if len(frames) == 1 else f"{s}@{name}": frame[s] for name, frame in frames.items() for s in b.signals}
    if b.baselines:
        base = baseline_signals(instruments, first_day, end, BaselineSettings(b.momentum_window, b.reversal_window),
                                freq=d.freq).reindex(index)  # only member stock-days, as the model's
        signals.update(base.items())

    results, daily = {}, {}
    for name, pred in signals.items():
        horizon = signal_horizon(name.split("@")[0], d.predict)  # "last@seed1" forecasts as "last" does
        log.info("scoring and backtesting %s (label horizon %d)", name, horizon)
        results[name], daily[name] = score_signal(cfg, pred, labels, horizon, bt_start, bt_end)

    seeds_ = [n for n in frames if n.startswith("seed")] or [""]
    spread = {s: seed_spread([results[f"{s}@{n}"] for n in seeds_]) for s in b.signals} if len(seeds_) > 1 else {}
    per_day = index.get_level_values("datetime").value_counts()
    table = summary_table(results, t_ok=float(per_day.median()) >= MIN_T_CROSS_SECTION)
    merged = pd.concat({n: f.drop(columns=["bench"]) for n, f in daily.items()}, axis=1)
    merged.columns = [f"{n}_{c}" for n, c in merged.columns]
    merged = merged.assign(bench=next(iter(daily.values()))["bench"])
    merged.index.name = "datetime"
    decay = {n: ic_decay(r["analysis"]) for n, r in results.items()}
    decay_table = pd.concat(decay, names=["signal", "horizon"])
    signals_table = pd.DataFrame(signals).join(labels).reset_index()

    report = {"summary": table.to_dict(orient="index"), "signals": results, "seed_spread": spread,
              "forecast_days": [str(first_day.date()), str(pd.Timestamp(index.get_level_values(0).max()).date())],
              "backtest_period": [str(bt_start.date()), str(bt_end.date())], "benchmark": benchmark_label(cfg),
              "warnings": warnings_, "label": f"{b.deal_price}(t+1+h) / {b.deal_price}(t+1) - 1, h = 1..{d.predict}",
              "forecasts": len(index), "instruments": len(instruments),
              "best": best_signal(signals, labels, results, list(base.columns) if b.baselines else [])}
    files = {
        "summary.csv": table.rename_axis("signal"),
        "signals.csv": signals_table,
        "ic_decay.csv": decay_table.reset_index(),
        "ic_decay.png": lambda p: plot_ic_decay({n: t for n, t in decay.items()
                                                 if "@seed" not in n or n.endswith(f"@{seeds_[0]}")}, p),
        "backtest_daily.csv": merged,
        "cumulative_return.png": lambda p: plot_cumulative(daily, report["benchmark"], p),
    }
    return report, files


def main(argv: list[str] | None = None) -> dict[str, Any]:
    setup_logging()
    args = parse_args(argv)
    require_extra("qlib")  # named before any work (the qlib imports below are lazy)
    cfg = load(args.config, args.set)
    out = Path(cfg.paths.backtest_result_path).expanduser()
    # One backtest per results folder (`.<name>.lock` beside it, as a forecast's), held until the summary is printed:
    # a second run into the folder refuses at once, and no run's "results in" line names another's files.
    with RunLock(out.parent, name=f".{out.name}.lock", key="paths.backtest_result_path"):
        for stale in out.parent.glob(f".{glob.escape(out.name)}.*.tmp"):  # what a killed backtest left beside it
            shutil.rmtree(stale, ignore_errors=True)
        return backtest(cfg, args.device, out)


def backtest(cfg: QlibConfig, device: str | None, out: Path) -> dict[str, Any]:
    """The backtest of `main`, under the results folder's lock: forecasts, scores, the sealed folder, the summary."""
    check_inputs(cfg)
    device = device or default_device()
    d, f = cfg.data, cfg.forecast

    split = load_split(split_path(d.dataset_path, "test"))  # memory-mapped
    calendar_ns = np.asarray(read_manifest(d.dataset_path)["calendar_ns"], dtype=np.int64)
    init_qlib(cfg)
    calendar = read_calendar(cfg)
    # The pair as trained: a tokenizer at paths.finetuned_tokenizer_path other than the predictor's is refused.
    predictor, tokenizer, _ = load_trained_pair(cfg.paths.finetuned_predictor_path, cfg.paths.finetuned_tokenizer_path)
    # Labels carry the seed value; zero-shot always samples with forecast.seed, whatever forecast.seeds lists.
    seeds = {f"seed{seed}": seed for seed in f.seed_list()}
    forecasters = {name: kronos_forecaster(tokenizer, predictor, cfg, device) for name in seeds}
    zero = zero_shot_models(cfg)
    if zero is not None:
        forecasters["zeroshot"], seeds["zeroshot"] = kronos_forecaster(*zero, cfg, device), f.seed
    report, files = evaluate(cfg, forecasters, split, calendar_ns, calendar, seeds)
    report.update(device=device, seeds=f.seed_list(), config=config_to_dict(cfg))
    publish(out, report, files)

    table = pd.DataFrame(report["summary"]).T
    table[["h", "days"]] = table[["h", "days"]].astype(int)
    print(f"\n--- signals {report['forecast_days'][0]}..{report['forecast_days'][1]}, backtest "
          f"{report['backtest_period'][0]}..{report['backtest_period'][1]} vs {report['benchmark']} ---")
    print("(IC at the horizon h each signal forecasts, t_IC the interval rule's on the normal scale (- where it has "
          "none); excess_ann, IR, max_dd with cost; turnover "
          "mean daily, cost_ann annualised cost)")
    print(table.to_string(float_format=lambda v: f"{v:.4f}", na_rep="-"))
    for s, sp in report["seed_spread"].items():
        print(f"{s}: over {sp['seeds']} seeds IC {sp['IC']['mean']:.4f} +- {sp['IC']['std']:.4f}, excess_ann "
              f"{sp['excess_return_with_cost_ann']['mean']:.4f} +- {sp['excess_return_with_cost_ann']['std']:.4f}")
    print(report["best"]["line"])
    for w in report["warnings"]:
        print(f"warning: {w}")
    print(f"\nresults in {out}")
    return report


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
