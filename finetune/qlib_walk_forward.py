"""Walk-forward for the Qlib pipeline: does finetuning pay out of sample, period after period?

    kronos qlib-walk-forward --config configs/qlib_demo.yaml [--device cpu] [--set walk_forward.period_months=3]

walk_forward.test_range (default data.test_time_range) is cut into consecutive test periods of `period_months`.
Period k, on the trading calendar (s = its first trading day; s-1 its first signal, which trades on s):

    dataset_begin .. train_end | purge | val_start .. val_end | purge | s-1 | s .. e (test period k)

Each period is preprocessed and finetuned by the usual trainers under torchrun (DIST_BACKEND=gloo on a CPU), then
forecast with the finetuned and the pretrained (zero-shot) pair; the verdict is on the paired daily IC difference
(finetune/evaluation/statistics.py). Method, outputs and the rule of a re-run: docs/qlib_evaluation.md "Walk-forward".
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from filelock import FileLock

from finetune.config import QlibConfig, check_model_folder, cli_parser, load
from finetune.dataset import SPLITS, check_processed, content_sha256, load_split, read_manifest, split_path
from finetune.evaluation.report import write_report
from finetune.evaluation.signals import daily_ic, forward_labels
from finetune.evaluation.statistics import mean_test, paired_test
from finetune.qlib_data_preprocess import first_signal_day, preprocess
from finetune.qlib_forecast import kronos_forecaster, signal_horizon
from finetune.qlib_io import benchmark_label, check_qlib_folder, init_qlib, read_calendar
from finetune.qlib_test import backtest_period, forecast_all, score_signal, write_results
from finetune.utils import tune
from finetune.utils.cli_args import parse_config_args
from finetune.utils.config_utils import Problems, config_to_dict, dump_config, plain
from finetune.utils.errors import require_extra, setup_logging
from finetune.utils.fingerprint import digest, forecast_settings, training_settings, tree_sha256
from finetune.utils.ledger import check_record, write_record
from finetune.utils.plots import pyplot, save_figure
from finetune.utils.safety import GracefulStop, raise_if_stop_requested
from model.errors import ConfigError, UserError
from model.fileio import atomic_write, read_json_or_empty, write_json
from model.hub import weights_fingerprint
from model.predictor import default_device, load_pretrained_pair, load_trained_pair

log = logging.getLogger("finetune.qlib")
CANDIDATES = ("finetuned", "zero_shot")


@dataclass(frozen=True)
class Period:
    """One walk-forward period: inclusive [start, end] dates of its three blocks."""

    k: int
    train: tuple[pd.Timestamp, pd.Timestamp]
    val: tuple[pd.Timestamp, pd.Timestamp]
    test: tuple[pd.Timestamp, pd.Timestamp]


def walk_forward_periods(calendar: pd.DatetimeIndex, begin, test_start, test_end, period_months: int,
                         val_months: int, purge: int) -> list[Period]:
    """The periods of the module docstring on `calendar` (trading days); ConfigError naming the setting when the
    data before a period cannot hold its purges, validation block and some training."""
    cal, begin, end = pd.DatetimeIndex(calendar), pd.Timestamp(begin), pd.Timestamp(test_end)
    periods, start = [], pd.Timestamp(test_start)
    while start <= end:
        stop = min(start + pd.DateOffset(months=period_months) - pd.Timedelta(days=1), end)
        first = int(cal.searchsorted(start))  # s: the period's first trading day
        if first >= len(cal) or cal[first] > stop:
            raise ConfigError([f"walk_forward.test_range: {start.date()}..{stop.date()} holds no trading day"])
        val_end = first - 2 - purge  # `purge` days strictly between the last validation target and s-1
        back = cal[max(val_end, 0)] - pd.DateOffset(months=val_months) + pd.Timedelta(days=1)
        val_start = int(cal.searchsorted(back))
        train_end = val_start - 1 - purge
        if val_end < 0 or train_end < 0 or cal[train_end] <= begin:
            raise ConfigError([f"walk_forward.test_range: period {len(periods)} ({start.date()}..{stop.date()}) "
                               f"leaves no training data after data.dataset_begin_time {begin.date()} once "
                               f"walk_forward.val_months and purge are set aside; start the span later"])
        periods.append(Period(len(periods), (begin, cal[train_end]), (cal[val_start], cal[val_end]), (start, stop)))
        start = stop + pd.Timedelta(days=1)
    return periods


def signal_days(calendar: pd.DatetimeIndex, periods: list[Period], k: int) -> tuple[pd.Timestamp, pd.Timestamp]:
    """[first, last] signal day that belongs to period k: from the day before its first trading day (which trades on
    it) to the day before the next period's first trading day (that one trades in the next period)."""
    first = first_signal_day(calendar, periods[k].test[0])
    if k + 1 == len(periods):
        return first, periods[k].test[1]
    return first, calendar[calendar < first_signal_day(calendar, periods[k + 1].test[0])][-1]


def period_config(cfg: QlibConfig, p: Period, folder: Path) -> QlibConfig:
    """`cfg` for one period: its three ranges, and every data / model / result path inside `folder`."""
    c = copy.deepcopy(cfg)
    iso = lambda r: [str(r[0].date()), str(r[1].date())]  # noqa: E731
    c.data.train_time_range, c.data.val_time_range, c.data.test_time_range = iso(p.train), iso(p.val), iso(p.test)
    c.data.dataset_path = str(folder / "data")
    c.paths.save_path = str(folder)
    for stage in ("tokenizer", "predictor"):
        setattr(c.paths, f"{stage}_dir", str(folder / f"finetune_{stage}"))
        setattr(c.paths, f"finetuned_{stage}_path", str(folder / f"finetune_{stage}" / "best_model"))
    c.paths.backtest_result_path = str(folder / "backtest")
    c.forecast.seeds = None
    return c


def prepare(c: QlibConfig) -> None:
    """Preprocess the period's data unless done with these settings and source; qlib initialised again after."""
    problems = Problems()
    check_processed(c, SPLITS, problems)
    if problems:
        preprocess(c)
    init_qlib(c)


def train_period(c: QlibConfig, folder: Path, nproc: int) -> None:
    """Run both trainers under torchrun (a finished stage is reused while current, else trained again:
    --skip-existing)."""
    (folder / "config.yaml").write_text(dump_config(c), encoding="utf-8")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for module in ("finetune.train_tokenizer", "finetune.train_predictor"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", module, "--config", str(folder / "config.yaml"), "--skip-existing"]
        with open(folder / "train.log", "a", encoding="utf-8") as out:
            proc, stopping = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env), False
            while proc.poll() is None:  # our stop request (SIGTERM, Ctrl-C) is passed on: the trainer saves, stops
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)
                if not stopping and GracefulStop.active is not None and GracefulStop.active.requested:
                    stopping = proc.send_signal(signal.SIGTERM) or True
        raise_if_stop_requested(f"while training {folder.name} (its checkpoint is kept)")
        if (rc := proc.returncode) != 0:
            raise UserError(f"walk-forward: {module} failed (exit {rc}) for {folder.name}; see {folder / 'train.log'}")


def period_signals(c: QlibConfig, folder: Path, zero: tuple, device: str, train: Callable[[], None] = lambda: None,
                   name: str = "signals.csv") -> pd.DataFrame:
    """Signals of the period's test days under `c`'s forecast settings (data `prepare`d), columns
    <signal>/<candidate>. Kept in `name` (written atomically) while the ledger finds it current: its bytes as
    recorded, made from these models, data and settings; then nothing is trained or forecast. Else `train()` (e.g.
    `train_period`) unless trained.json records these models as trained from these settings and data (a trainer
    started only to skip its finished stage costs a torchrun start), then a forecast; the file is read back either
    way, so a rerun scores the very numbers the first run did."""
    zero_shot, cache, trained = [weights_fingerprint(m) for m in zero], folder / name, folder / "trained.json"
    made = lambda: {"predictor": tree_sha256(c.paths.finetuned_predictor_path), "zero_shot": zero_shot,  # noqa: E731
                    "settings": training_settings(c), "data": content_sha256(c.data.dataset_path)}
    if check_record(cache, {**made(), "forecast": forecast_settings(c)}) != "reuse":
        models = lambda: plain({**made(), "tokenizer": tree_sha256(c.paths.finetuned_tokenizer_path)})  # noqa: E731
        if read_json_or_empty(trained) != models():
            train()
            write_json(trained, models())
        table = forecast_signals(c, zero, device)
        atomic_write(cache, lambda p: table.reset_index().to_csv(p, index=False))
        write_record(cache, {**made(), "forecast": forecast_settings(c)})
    return pd.read_csv(cache, parse_dates=["datetime"]).set_index(["datetime", "instrument"])


def forecast_signals(c: QlibConfig, zero: tuple, device: str) -> pd.DataFrame:
    """Both candidates' signals over the period's test days, columns <signal>/<candidate>."""
    d = c.data
    predictor, tokenizer, _ = load_trained_pair(c.paths.finetuned_predictor_path, c.paths.finetuned_tokenizer_path)
    make = lambda tok, pred: kronos_forecaster(tok, pred, c, device)  # noqa: E731
    calendar_ns = np.asarray(read_manifest(d.dataset_path)["calendar_ns"], dtype=np.int64)
    first = first_signal_day(pd.DatetimeIndex(calendar_ns.astype("datetime64[ns]")), pd.Timestamp(d.test_time_range[0]))
    frames = forecast_all(c, {"finetuned": make(tokenizer, predictor), "zero_shot": make(*zero)}, None,
                          load_split(split_path(d.dataset_path, "test")), calendar_ns, first)
    table = pd.concat(frames, axis=1)
    table.columns = [f"{s}/{cand}" for cand, s in table.columns]
    return table


def score(cfg: QlibConfig, periods: list[Period], signals: pd.DataFrame, calendar: pd.DatetimeIndex) -> dict:
    """Per-period and overall IC of both candidates, the verdict, and the backtest over the whole span."""
    w, d = cfg.walk_forward, cfg.data
    h = signal_horizon(w.signal, d.predict)
    first, last = signals.index.get_level_values("datetime").min(), periods[-1].test[1]
    instruments = sorted(set(signals.index.get_level_values("instrument")))
    label = forward_labels(instruments, first, last, cfg.backtest.deal_price, [h], d.freq).reindex(signals.index)
    t = lambda x: mean_test(x.to_numpy(), h - 1)["t"]  # noqa: E731 - daily IC's t (the interval rule), lag h - 1
    rows, daily = [], {}
    for p in [*periods, None]:
        when = signals.index.get_level_values("datetime")
        rows.append({"period": "all" if p is None else p.k, "test_start": str((p.test[0] if p else first).date()),
                     "test_end": str((p.test[1] if p else last).date()),
                     "train_end": str(p.train[1].date()) if p else "", "val": f"{p.val[0].date()}..{p.val[1].date()}"
                     if p else ""})
        lo, hi = (first, last) if p is None else signal_days(calendar, periods, p.k)
        keep = (when >= lo) & (when <= hi)
        for cand in CANDIDATES:
            ic, ric = daily_ic(signals.loc[keep, f"{w.signal}/{cand}"], label.loc[keep, f"label_{h}"])
            rows[-1].update({f"IC_{cand}": float(ic.mean()), f"t_IC_{cand}": t(ic), f"RankIC_{cand}": float(ric.mean()),
                             f"t_RankIC_{cand}": t(ric), f"days_{cand}": len(ic)})
            daily[cand] = ic
    table = pd.DataFrame(rows).set_index("period")
    table["IC_diff"] = table["IC_finetuned"] - table["IC_zero_shot"]
    diff = (daily["finetuned"] - daily["zero_shot"]).dropna()
    verdict = {**paired_test(diff.to_numpy(), diff.index, max(h, w.block_days) - 1, higher_is_better=True,
                             what="finetuned - zero-shot mean daily IC"), "share_days_better": float((diff > 0).mean())}
    bt0, bt1 = backtest_period(calendar, periods[0].test[0], last)
    backtest = {}
    for cand in CANDIDATES:
        out, frame = score_signal(cfg, signals[f"{w.signal}/{cand}"].dropna(), label, h, bt0, bt1)
        backtest[cand] = {**out["backtest"], "daily_net": (frame["return"] - frame["cost"])}
    return {"table": table, "verdict": verdict, "backtest": backtest, "diff": diff, "horizon": h,
            "backtest_period": [str(bt0.date()), str(bt1.date())]}


def plot(result: dict, periods: list[Period], path: Path) -> None:
    """Per-period mean daily IC of both candidates (+- 2 standard errors on the
    interval rule's normal scale, none where the rule claims no interval) and the cumulative daily IC
    difference over the span, period boundaries marked; legends outside the axes."""
    plt = pyplot()
    table = result["table"].drop(index="all")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7))
    x = np.arange(len(table))
    for i, (cand, colour) in enumerate(zip(CANDIDATES, ("tab:blue", "tab:gray"))):
        ic, t = table[f"IC_{cand}"].astype(float), table[f"t_IC_{cand}"].astype(float)
        top.bar(x + (i - 0.5) * 0.38, ic, 0.38, yerr=2 * (ic / t).abs().fillna(0), color=colour, capsize=3,
                label=cand.replace("_", "-"))
    top.axhline(0, color="k", lw=0.8)
    top.set_xticks(x, [f"{a}..{b}" for a, b in zip(table["test_start"], table["test_end"])], fontsize=8)
    top.set(ylabel="mean daily IC", title="IC per test period (bars: +-2 s.e., none where no interval)")
    diff = result["diff"]
    bottom.plot(diff.index, diff.cumsum(), color="tab:blue", label="finetuned - zero-shot")
    for p in periods[1:]:
        bottom.axvline(p.test[0], color="k", ls=":", lw=0.8)
    v = result["verdict"]
    bottom.set(ylabel="cumulative daily IC difference",
               title=f"Verdict: {v['verdict']} (mean {v['mean']:+.4f}" + (
                   f", 95% [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}])" if v["ci_low"] is not None else ")"))
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    save_figure(fig, path, dpi=100, bbox_inches="tight")


def check_inputs(cfg: QlibConfig) -> None:
    problems = cfg.problems()
    for key in ("pretrained_tokenizer", "pretrained_predictor"):
        value = getattr(cfg.model, key)
        problems.check(bool(value), f"model.{key}", "is needed: the walk-forward compares finetuned with zero-shot")
        check_model_folder(value, f"model.{key}", problems, hub_ok=True)
    check_qlib_folder(cfg, problems)
    problems.raise_if_any()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    with GracefulStop():  # SIGTERM / first Ctrl-C: the period's trainer saves and stops, then exit 75 (as a trainer)
        return _main(argv)


def _main(argv: list[str] | None) -> dict[str, Any]:
    setup_logging()
    parser = cli_parser(__doc__)
    parser.add_argument("--device", default=None, help="forecast on cuda, cpu, ... (default: cuda if available)")
    args = parse_config_args(parser, argv)
    require_extra("qlib")  # named before any work (the qlib imports are lazy)
    cfg = load(args.config, args.set)
    check_inputs(cfg)
    device = args.device or default_device()
    w, d = cfg.walk_forward, cfg.data
    init_qlib(cfg)
    calendar = read_calendar(cfg)
    span = w.test_range or d.test_time_range
    periods = walk_forward_periods(calendar, d.dataset_begin_time, span[0], span[1], w.period_months,
                                   w.val_months, w.purge or d.predict)
    root = Path(cfg.paths.save_path).expanduser() / "walk_forward"
    # (tokenizer, predictor): the order the period folders record their fingerprints in
    zero = load_pretrained_pair(cfg.model.pretrained_predictor, cfg.model.pretrained_tokenizer)[::-1]
    frames, started = [], time.monotonic()
    for p in periods:
        raise_if_stop_requested(f"before period {p.k}")
        folder = root / f"period_{p.k}"
        folder.mkdir(parents=True, exist_ok=True)
        c = period_config(cfg, p, folder)
        prepare(c)
        lo, hi = signal_days(calendar, periods, p.k)
        frame = period_signals(c, folder, zero, device, partial(train_period, c, folder, w.nproc_per_node))
        frames.append(frame[(frame.index.get_level_values("datetime") >= lo)
                            & (frame.index.get_level_values("datetime") <= hi)])
        spent = time.monotonic() - started
        log.info("period %d of 0..%d test %s..%s (train ..%s, val %s..%s): done; %.0f s so far, "
                 "~%.0f s left", p.k, len(periods) - 1, p.test[0].date(), p.test[1].date(), p.train[1].date(),
                 p.val[0].date(), p.val[1].date(), spent, spent / (p.k + 1) * (len(periods) - p.k - 1))
    signals = pd.concat(frames).sort_index()
    result = score(cfg, periods, signals, calendar)
    table, v = result["table"], result["verdict"]
    report = {"verdict": v["verdict"], "reason": v["reason"], "paired_daily_ic": v, "signal": w.signal,
              "horizon": result["horizon"], "periods": table.reset_index().to_dict(orient="records"),
              "backtest_period": result["backtest_period"], "benchmark": benchmark_label(cfg),
              "backtest": {c: {k: x for k, x in b.items() if k != "daily_net"} for c, b in result["backtest"].items()},
              "device": device, "config": config_to_dict(cfg)}
    write_results(root, {"report.json": report, "periods.csv": table, "signals.csv": signals.reset_index(),
                         "walk_forward.png": lambda path: plot(result, periods, path)})
    write_report(root)
    cols = ["test_start", "test_end", "days_finetuned", "IC_finetuned", "t_IC_finetuned", "IC_zero_shot",
            "t_IC_zero_shot", "IC_diff"]
    print(f"\n--- walk-forward: {len(periods)} periods, signal {w.signal} at h={result['horizon']} (daily IC, "
          f"t: statistics.mean_test), backtest {result['backtest_period'][0]}..{result['backtest_period'][1]} vs "
          f"{report['benchmark']} ---")
    print(table[cols].rename(columns=lambda s: s.replace("_finetuned", "_ft").replace("_zero_shot", "_zs"))
          .to_string(float_format=lambda x: f"{x:.4f}"))
    for cand, b in report["backtest"].items():
        ex = b["excess_return_with_cost"]
        print(f"{cand:<10} excess_ann {ex['annualized_return']:+.4f}  IR {ex['information_ratio']:+.3f}  max_dd "
              f"{ex['max_drawdown']:.4f}  turnover {b['turnover_mean']:.3f}  cost_ann {b['cost_ann']:.4f}")
    print(f"verdict: {v['verdict']} - {v['reason']}; finetuned better on {v['share_days_better']:.0%} of days")
    print(f"results in {root}")
    return report


def tune_main(argv: list[str] | None = None) -> int:
    """`kronos qlib-tune`: the study of finetune/utils/tune.py on `tune.inner_folds` periods whose labels end purge
    days before the first judged signal, scored by the daily IC of the traded label (zero-shot - finetuned)."""
    setup_logging()
    parser = cli_parser("Which finetuning settings pay? A study judged on the walk-forward's periods (Qlib).")
    parser.add_argument("--device", default=None, help="forecast on cuda, cpu, ... (default: cuda if available)")
    args = parse_config_args(tune.add_worker_args(parser), argv)
    require_extra("qlib")
    cfg = load(args.config, args.set)
    build = lambda values: load(args.config, [*args.set, *(f"{k}={json.dumps(v)}" for k, v in values.items())])
    tune.check_space(cfg.tune, build)
    if cfg.tune.mode == "nested":
        raise ConfigError(["tune.mode: nested is kronos tune's (CSV) only; set tune.mode: holdout for qlib-tune"])
    check_inputs(cfg)
    device, w, d, tc = args.device or default_device(), cfg.walk_forward, cfg.data, cfg.tune
    init_qlib(cfg)
    calendar, h, purge = read_calendar(cfg), signal_horizon(w.signal, d.predict), w.purge or d.predict
    span, lag = w.test_range or d.test_time_range, max(h, w.block_days) - 1
    periods = lambda a, b: walk_forward_periods(calendar, d.dataset_begin_time, a, b, w.period_months, w.val_months,
                                                purge)
    outer = periods(*span[:2])
    last = calendar[calendar < first_signal_day(calendar, outer[0].test[0])][-2 - purge - h]  # its label ends before
    inner = periods(last - pd.DateOffset(months=w.period_months * tc.inner_folds) + pd.Timedelta(days=1), last)
    root, zero = Path(cfg.paths.save_path).expanduser() / "tune", load_pretrained_pair(
        cfg.model.pretrained_predictor, cfg.model.pretrained_tokenizer)[::-1]

    def daily(c: QlibConfig, ps: list[Period]) -> dict[str, pd.Series]:
        """Daily IC of both candidates of trial settings `c` over the signal days of periods `ps`."""
        frames = []
        for p in ps:  # a unit: trained once (forecast settings fixed to the given ones), forecast once per forecast
            unit = dataclasses.replace(c, forecast=cfg.forecast)  # period_config copies it
            settings = {k: v for k, v in config_to_dict(unit).items() if k not in ("paths", "tune")}
            folder = root / "units" / tune.unit_fingerprint(settings, [str(x.date()) for x in (*p.train, *p.val,
                                                            *p.test)], [str(calendar[0]), str(calendar[-1])])
            folder.mkdir(parents=True, exist_ok=True)
            with FileLock(str(folder) + ".lock"):
                pc = period_config(unit, p, folder)
                prepare(pc)
                fc = copy.deepcopy(pc)  # the trial's forecast settings, each kept in its own sealed signals file
                fc.forecast, fc.forecast.seeds = copy.deepcopy(c.forecast), None
                frame = period_signals(fc, folder, zero, device, partial(train_period, pc, folder, w.nproc_per_node),
                                       f"signals_{digest(forecast_settings(fc))[:12]}.csv")
            lo, hi = signal_days(calendar, ps, p.k)
            frames.append(frame[(frame.index.get_level_values("datetime") >= lo)
                                & (frame.index.get_level_values("datetime") <= hi)])
        sig = pd.concat(frames).sort_index()
        when, names = sig.index.get_level_values("datetime"), sorted(set(sig.index.get_level_values("instrument")))
        label = forward_labels(names, when.min(), when.max(), cfg.backtest.deal_price, [h], d.freq).reindex(sig.index)
        return {k: daily_ic(sig[f"{w.signal}/{k}"], label[f"label_{h}"])[0] for k in CANDIDATES}

    def objective(params: dict, number: int) -> dict:
        ic = daily(build(params), inner)
        return {str(k.date()): float(v) for k, v in (ic["zero_shot"] - ic["finetuned"]).dropna().items()}

    identity = {"settings": {k: v for k, v in config_to_dict(cfg).items() if k not in ("paths", "tune")},
                "space": tc.space, "seed": tc.seed, "inner": [str(p.test) for p in inner]}
    found = tune.run(root, tc, identity, [str(p.test) for p in outer], config_to_dict(cfg), objective, args,
                     "qlib-tune", lambda x, dates, **kw: paired_test(x, dates, lag, **kw))
    if found is None:
        return 0
    tuned, given = daily(build(found["selected"]["settings"]), outer), daily(cfg, outer)
    ic = {"tuned": tuned["finetuned"], "default": given["finetuned"], "zero_shot": tuned["zero_shot"]}
    diff = {f"tuned_vs_{k}": (ic["tuned"] - ic[k]).dropna() for k in ("zero_shot", "default")}
    result = {k: paired_test(x.to_numpy(), x.index, lag, what=f"daily IC {k}", higher_is_better=True)
              for k, x in diff.items()}
    ranking = {k: float(x.mean()) for k, x in ic.items()}
    tune.write_report(root, found, result, {"candidate": max(ranking, key=ranking.get), "ranking": ranking})
    write_report(root)  # tune/report.html
    return 0


if __name__ == "__main__":
    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
