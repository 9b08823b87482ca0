"""report.html: one offline page per run, built only from the files the run wrote (`kronos report RUN_DIR`
rebuilds it). Which commands write it and which files it reads: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import argparse
import datetime
import html
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from finetune.utils.metrics import read_metrics
from model.errors import PathError
from model.features import FEATURES
from model.fileio import SEAL_NAME, atomic_write, check_seal, read_json_or_empty, seal, strict_json

TEMPLATE = Path(__file__).with_name("report_template.html")
# The page stays under 8 MB: Plotly takes 4.6 MB, the forecast windows at most WINDOW_BYTES (evenly spaced windows
# beyond that, said on the page), the training curves at most MAX_POINTS records over all stages.
MAX_WINDOWS, WINDOW_BYTES, MAX_POINTS = 400, 2 * 2**20, 20_000
CURVES = ("kind", "step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "score")  # drawn keys
CONTEXT_BARS = 3  # context bars drawn before a window = this many x the forecast horizon (at most the lookback)
GENERATED = "<!--generated-->"  # the one line that differs between two builds of the same run: when it was built


def _json(path: Path) -> dict | None:
    return read_json_or_empty(path) or None  # a torn or foreign file: the page says what it could not read


def _csv(path: Path) -> pd.DataFrame | None:
    try:
        return pd.read_csv(path) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _name(run: Path) -> str:
    """The run as the page names it: its folder and the output folder in it (csv_demo/forecast), never the absolute
    path (a page is shared, screenshotted; the path says where it was built, not what it shows)."""
    return "/".join(run.parts[-2:])


def _thin(items: list, limit: int) -> list:
    """At most `limit` of `items`, evenly spaced, the first and last kept."""
    if len(items) <= limit:
        return items
    return [items[i] for i in np.linspace(0, len(items) - 1, limit).round().astype(int)]


def _columns(frame: pd.DataFrame) -> dict[str, list]:
    """A frame as {column: values} for the charts: floats to 7 significant digits (a chart draws no more), NaN ->
    null."""
    return {c: [None if v != v else float(f"{v:.7g}") for v in frame[c].tolist()] if frame[c].dtype.kind == "f"
            else strict_json(frame[c].tolist()) for c in frame.columns}


def write_context(run_dir: str | Path, names: list[str], timestamps: list, context: np.ndarray, horizon: int) -> None:
    """context.csv: the last CONTEXT_BARS x `horizon` context candles (W, L, 6) of each forecast window, the window
    numbering of forecast.csv (a future forecast: one window per series, in `names`' order)."""
    tail = min(context.shape[1], CONTEXT_BARS * horizon)
    parts = [pd.DataFrame({"window": i, "series": name, "timestamps": pd.DatetimeIndex(ts)[-tail:],
                           **{f: context[i, -tail:, j] for j, f in enumerate(FEATURES)}})
             for i, (name, ts) in enumerate(zip(names, timestamps))]
    frame = pd.concat(parts, ignore_index=True)
    atomic_write(Path(run_dir) / "context.csv", lambda p: frame.to_csv(p, index=False))


def _windows(run: Path) -> dict | None:
    """Each forecast window's context, forecast (median close and its 50% / 80% bands: forecast.csv's quantiles,
    calibrated when the predictor is) and, held out, its actual candles."""
    fc = _csv(run / "forecast.csv")
    if fc is None or "close_q50" not in fc.columns:
        return None
    ctx = _csv(run / "context.csv")
    future = "window" not in fc.columns  # --future: one window per series
    key = "series" if future else "window"
    groups = list(fc.groupby(key, sort=False))
    by_ctx = dict(list(ctx.groupby(key, sort=False))) if ctx is not None else {}  # it has both columns
    quantiles = [c for c in fc.columns if c.startswith("close_q") or c.startswith("raw_close_q")]

    def window(k, g: pd.DataFrame) -> dict:
        item = {"series": str(g["series"].iloc[0]), "window": None if future else int(k),
                "forecast": _columns(g[["timestamps", *quantiles]])}
        if "actual_close" in g.columns:
            item["actual"] = _columns(g[["timestamps", *(f"actual_{f}" for f in ("open", "high", "low", "close"))]])
        if k in by_ctx:
            item["context"] = _columns(by_ctx[k][["timestamps", "open", "high", "low", "close"]])
        return item

    sample = [window(*kg) for kg in _thin(groups, 20)]  # the bytes of one window, to fit WINDOW_BYTES
    fit = int(WINDOW_BYTES * len(sample) / len(json.dumps(sample)))
    out = [window(*kg) for kg in _thin(groups, max(1, min(MAX_WINDOWS, fit)))]
    return {"future": future, "windows": out, "total": len(groups), "has_context": ctx is not None}


def _training(roots: list[Path]) -> list[dict]:
    """Every training stage found one level below `roots` (or two, for walk-forward folds): its metrics.jsonl
    records (thinned), the settings it ran with (run_info.json) and the forecaster's kronos_predictor.json."""
    found: dict[Path, Path] = {}  # metrics.jsonl -> the root it was found under (its name on the page)
    for root in (r.resolve() for r in roots):
        for path in sorted([*root.glob("*/metrics.jsonl"), *root.glob("*/*/metrics.jsonl")]):
            found.setdefault(path.resolve(), root)
    stages, limit = [], MAX_POINTS // max(2 * len(found), 1)  # records per stage and kind
    for path, root in found.items():
        records, info = read_metrics(path), _json(path.parent / "run_info.json") or {}
        curves = {kind: strict_json(_thin([{k: v for k, v in r.items() if k in CURVES or k.startswith("metric_")}
                                           for r in records if r.get("kind") == kind], limit))
                  for kind in ("train", "val")}
        stages.append({"name": str(path.parent.relative_to(root)), **curves, "config": info.get("config"),
                       "predictor": _json(path.parent / "best_model" / "kronos_predictor.json")})
    return stages


def collect(run_dir: str | Path) -> dict[str, Any]:
    """Everything the page shows, read from `run_dir`'s files (docs/architecture.md, "report.html")."""
    run = Path(run_dir).resolve()
    metrics, report = _json(run / "metrics.json"), _json(run / "report.json")
    tune = report if run.name == "tune" and report else _json(run / "tune" / "report.json")
    report = None if report is tune else report
    # where the training stages are: beside a forecast's folder; inside a walk-forward's (one per fold or period);
    # under paths.save_path for a Qlib backtest
    roots = [run.parent]
    page: dict[str, Any] = {"run": _name(run), "kind": "tune" if tune else "run", "metrics": metrics,
                            "forecast": _windows(run), "tune": tune}
    if metrics is not None or page["forecast"] is not None:
        page["kind"] = "forecast" if metrics is not None else "future"
    elif report is not None and "folds" in report:  # CSV walk-forward
        page["kind"], page["walk_forward"], roots = "walk_forward", report, [run]
        wins = _csv(run / "windows.csv")
        if wins is not None and {"candidate", "window_start", "crps"} <= set(wins.columns):
            used = wins[wins["in_verdict"].astype(bool)] if "in_verdict" in wins.columns else wins
            cum = {name: g.groupby("window_start")["crps"].mean().sort_index().cumsum()  # as walk_forward.png
                   for name, g in used.groupby("candidate", sort=False)}
            page["walk_forward_cumulative"] = {n: {"t": v.index.tolist(), "v": strict_json(v.tolist())}
                                               for n, v in cum.items()}
    elif report is not None and "periods" in report:  # Qlib walk-forward
        page["kind"], page["qlib_walk_forward"], roots = "qlib_walk_forward", report, [run]
    elif report is not None and "summary" in report:  # Qlib backtest
        page["kind"], page["qlib"] = "qlib", _qlib(run, report)
        roots = [Path(p).expanduser() for p in [((report.get("config") or {}).get("paths") or {}).get("save_path")]
                 if p]
    page["training"] = _training(roots)
    return page


def _qlib(run: Path, report: dict) -> dict:
    """IC / RankIC by horizon (ic_decay.csv) and by date (report.json), cumulative return / excess return with cost
    and turnover per signal (backtest_daily.csv, summed as cumulative_return.png does)."""
    out = {"report": {k: v for k, v in report.items() if k != "config"}}
    decay = _csv(run / "ic_decay.csv")
    if decay is not None:
        out["decay"] = {s: _columns(g.drop(columns="signal")) for s, g in decay.groupby("signal", sort=False)}
    daily = _csv(run / "backtest_daily.csv")
    if daily is not None and "bench" in daily.columns:
        names = [c[: -len("_return")] for c in daily.columns if c.endswith("_return")]
        net = {n: daily[f"{n}_return"] - daily[f"{n}_cost"] for n in names}
        out["daily"] = {"t": daily["datetime"].astype(str).tolist(),
                        "bench": strict_json(daily["bench"].cumsum().tolist()),
                        "cumulative": {n: strict_json(v.cumsum().tolist()) for n, v in net.items()},
                        "excess": {n: strict_json((v - daily["bench"]).cumsum().tolist()) for n, v in net.items()},
                        "turnover": {n: strict_json(daily[f"{n}_turnover"].tolist()) for n in names
                                     if f"{n}_turnover" in daily.columns}}
    signals = _csv(run / "signals.csv")
    if signals is not None and "datetime" in signals.columns:  # daily IC / RankIC (as Qlib's calc_ic: per-date
        out["ic_by_date"] = {}  # Pearson, Spearman) of each signal at its own horizon: no file holds them
        for name, r in report.get("signals", {}).items():
            label = f"label_{r.get('horizon')}"
            if name in signals.columns and label in signals.columns:
                pair = signals[["datetime", name, label]].dropna().set_axis(["datetime", "x", "y"], axis=1)
                ic = pair.groupby("datetime").apply(lambda g: g.x.corr(g.y))
                ric = pair.groupby("datetime").apply(lambda g: g.x.corr(g.y, method="spearman"))
                out["ic_by_date"][name] = {"datetime": ic.index.astype(str).tolist(), "ic": strict_json(ic.tolist()),
                                           "rank_ic": strict_json(ric.tolist())}
    return out


def render(page: dict[str, Any]) -> str:
    """The self-contained HTML of `page` (`collect`'s answer): the template with the Plotly bundle and the data."""
    from plotly.offline import get_plotlyjs  # imported here: only pages need the 4.6 MB bundle

    data = json.dumps(strict_json(page), allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    values = {"/*PLOTLY_JS*/": get_plotlyjs(), "/*PAGE_DATA*/null": data,
              GENERATED: f"<span id=generated>{stamp}</span>",
              "__TITLE__": html.escape(f"{page['kind'].replace('_', ' ')}: {page['run']}")}
    # one pass over the template: what is put in is never searched again (the data may hold any placeholder)
    return re.sub("|".join(map(re.escape, values)), lambda m: values[m.group()], TEMPLATE.read_text(encoding="utf-8"))


def write_report(run_dir: str | Path, context: tuple | None = None, horizon: int | None = None,
                 shown: str | Path | None = None) -> Path:
    """Write run_dir/report.html (atomically) from the run's files; `context` = (names, timestamps, (W, L, 6) bars)
    of the forecast windows, stored first as context.csv for the page and for `kronos report` later; `shown`: the
    folder the page names when `run_dir` is a temporary one about to be swapped into its place."""
    if context is not None:
        write_context(run_dir, *context, horizon=horizon or context[2].shape[1])
    page = collect(run_dir)
    text = render({**page, "run": _name(Path(shown).resolve())} if shown else page)
    return atomic_write(Path(run_dir) / "report.html", lambda p: Path(p).write_text(text, encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kronos report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a run's output folder (forecast/, future/, walk_forward/, a backtest ...)")
    args = parser.parse_args(argv)
    run = Path(args.run_dir)
    readable = ("metrics.json", "report.json", "forecast.csv", "tune/report.json")
    if not run.is_dir() or not any((run / name).is_file() for name in readable):
        raise PathError(f"{run} holds none of {', '.join(readable)}: pass the output folder of kronos forecast, "
                        "walk-forward, tune, qlib-backtest or qlib-walk-forward")
    sealed = (run / SEAL_NAME).is_file()  # a folder written whole (kronos forecast): checked, then sealed again
    if sealed:
        check_seal(run, "run the command that wrote it again", skip=("report.html",), exact=True)
    print(f"written: {write_report(run)}")
    if sealed:
        seal(run)
    return 0
