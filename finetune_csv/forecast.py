"""Forecast with the finetuned models: score every held-out test window, or forecast past the end of the data.

    python finetune_csv/forecast.py --config configs/csv_demo.yaml             # held-out evaluation
    python finetune_csv/forecast.py --config configs/csv_demo.yaml --future    # the next data.predict candles

Held-out evaluation: every window of each series' test split (data.test_ratio > 0), starts `forecast.window_stride`
rows apart (default data.predict: the horizons tile the split without overlap), each with `data.lookback` candles of
context (which may reach into the validation rows, as in training) and `forecast.sample_count` sampled paths
(KronosPredictor.generate). The close is scored in return space by finetune.evaluation.forecast_scores (MAE, MASE,
CRPS, pinball / WQL, 50% / 80% coverage, direction of the cumulative move, bootstrap intervals, per-series table,
persistence and seasonal-naive baselines). When model.pretrained_predictor is set and loadable, the same windows are
forecast with it (zero-shot) and the paired difference finetuned - zero-shot is reported with a bootstrap interval.
Written to `<base_dir>/forecast/`: metrics.json (strict JSON), forecast.csv, forecast_vs_actual.png.

--future: the `data.predict` candles after each series' last row (timestamps from the series' own bar times and
trading days, or `forecast.calendar`), written to `<base_dir>/future/`: forecast.csv (long format, one row per
series and timestamp: mean and quantiles of each feature) and forecast.png (quantile bands, real dates).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from finetune.evaluation.bootstrap import bootstrap_ci
from finetune.evaluation.forecast_baselines import infer_season
from finetune.evaluation.forecast_scores import ScoreSettings, score_forecasts
from finetune.evaluation.scoring_rules import crps_ensemble
from finetune.utils.config_utils import add_config_args
from finetune_csv import config as csv_config
from finetune_csv.config import CsvFinetuneConfig
from finetune_csv.forecast_metrics import candle_violations
from finetune_csv.forecast_plot import Panel, plot_panels
from finetune_csv.future_calendar import future_timestamps, read_calendar
from finetune_csv.held_out import CLOSE, HeldOutWindows, held_out_windows, sample_paths
from finetune_csv.model_dirs import best_dir, predictor_tokenizer_source
from finetune_csv.prepared import prepare_data
from model import Kronos, KronosPredictor, KronosTokenizer
from model.features import FEATURES, calc_time_stamps
from model.fileio import write_json

log = logging.getLogger("finetune_csv.forecast")
TABLE_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)  # quantile columns of forecast.csv (the plot's bands + median)


def make_predictor(predictor_src, tokenizer_src, cfg: CsvFinetuneConfig) -> KronosPredictor:
    """A KronosPredictor over a lookback + predict window (the sequence length the predictor was trained on)."""
    tokenizer = tokenizer_src if isinstance(tokenizer_src, KronosTokenizer) else \
        KronosTokenizer.from_pretrained(tokenizer_src)
    model = predictor_src if isinstance(predictor_src, Kronos) else Kronos.from_pretrained(predictor_src)
    return KronosPredictor(model, tokenizer, device="cuda:0" if torch.cuda.is_available() else "cpu",
                           max_context=cfg.data.lookback + cfg.data.predict, clip=cfg.data.clip, use_cache=True)


def finetuned_predictor(cfg: CsvFinetuneConfig) -> KronosPredictor:
    """The run's best predictor with the tokenizer it was trained with; a clear error when there is none."""
    predictor_dir = best_dir(cfg.predictor_dir)
    if not (predictor_dir / "config.json").is_file():
        raise ValueError(f"no trained predictor in {predictor_dir}; run finetune_csv/train_sequential.py first")
    return make_predictor(predictor_dir, predictor_tokenizer_source(cfg), cfg)


def zero_shot_predictor(cfg: CsvFinetuneConfig) -> KronosPredictor | None:
    """The starting model (model.pretrained_predictor + its tokenizer), or None with one log line when there is none
    or it cannot be loaded (e.g. a Hub id without network)."""
    m = cfg.model
    if not cfg.forecast.compare_pretrained or m.pretrained_predictor is None:
        return None
    tokenizer_src = m.pretrained_tokenizer or predictor_tokenizer_source(cfg)
    try:
        return make_predictor(m.pretrained_predictor, tokenizer_src, cfg)
    except Exception as exc:  # noqa: BLE001 - any load failure (network, files, shapes) only skips the comparison
        log.warning("zero-shot comparison skipped: cannot load model.pretrained_predictor=%s with tokenizer %s (%s)",
                    m.pretrained_predictor, tokenizer_src, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def _season(cfg: CsvFinetuneConfig, timestamps: pd.DatetimeIndex) -> int | None:
    """The seasonal-naive season: forecast.season, else inferred from a series' `timestamps` (bars per day intraday,
    5 for daily bars); None (logged) when it cannot be inferred or is longer than the lookback."""
    season = cfg.forecast.season
    if season is None:
        try:
            season = infer_season(timestamps)
        except ValueError as exc:
            log.info("no seasonal-naive baseline: %s (set forecast.season)", exc)
            return None
    if season > cfg.data.lookback:
        log.info("no seasonal-naive baseline: its season (%d bars) is longer than data.lookback (%d); "
                 "set forecast.season", season, cfg.data.lookback)
        return None
    return season


def _window_crps(paths: np.ndarray, windows: HeldOutWindows) -> tuple[np.ndarray, np.ndarray]:
    """Per-window mean CRPS and MAE of the median (W,) of the close, in returns from the last context close."""
    last = windows.context[:, -1, CLOSE]  # (W,)
    obs = windows.actual[..., CLOSE] / last[:, None] - 1.0  # (W, H)
    ens = np.moveaxis(paths[..., CLOSE] / last[:, None, None] - 1.0, 1, -1)  # (W, H, S)
    return crps_ensemble(obs, ens).mean(axis=1), np.abs(np.median(ens, axis=-1) - obs).mean(axis=1)


def paired_difference(finetuned: np.ndarray, zero_shot: np.ndarray, windows: HeldOutWindows,
                      settings: ScoreSettings) -> dict:
    """Finetuned - zero-shot CRPS and MAE per window (same windows), each with a bootstrap CI; < 0 = finetuned
    better. `finetuned`, `zero_shot`: sample paths (W, S, P, 6)."""
    crps_f, mae_f = _window_crps(finetuned, windows)
    crps_z, mae_z = _window_crps(zero_shot, windows)
    out = {"crps": crps_f.mean() - crps_z.mean(), "mae": mae_f.mean() - mae_z.mean(),
           "windows_finetuned_better_crps": float((crps_f < crps_z).mean())}
    if settings.n_boot > 0:
        n = len(windows)
        boot = lambda d: bootstrap_ci(lambda i: d[i].mean(), n, settings.n_boot, settings.block, settings.seed,
                                      settings.level)
        out["bootstrap"] = {"crps": boot(crps_f - crps_z), "mae": boot(mae_f - mae_z)}
    return out


def forecast_table(names: list[str], stamps: list[pd.DatetimeIndex], paths: np.ndarray,
                   actual: np.ndarray | None = None) -> pd.DataFrame:
    """Long table, one row per series (window) and forecast bar: mean `pred_<f>` and quantiles `pred_<f>_q<NN>`
    of each feature over the sample paths `(W, S, P, 6)`, plus `actual_<f>` when the actual candles `(W, P, 6)`
    are known."""
    mean = paths.mean(axis=1)  # (W, P, 6)
    quant = np.quantile(paths, TABLE_QUANTILES, axis=1)  # (Q, W, P, 6)
    parts = []
    for i, (name, ts) in enumerate(zip(names, stamps)):
        part = pd.DataFrame({"window": i, "series": name, "timestamps": ts})
        for j, f in enumerate(FEATURES):
            part[f"pred_{f}"] = mean[i, :, j]
            for k, q in enumerate(TABLE_QUANTILES):
                part[f"pred_{f}_q{round(q * 100):02d}"] = quant[k, i, :, j]
            if actual is not None:
                part[f"actual_{f}"] = actual[i, :, j]
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    frame.to_csv(tmp, index=False)
    tmp.replace(path)


def format_report(metrics: dict) -> str:
    """One short table: each forecaster's headline scores, then the paired differences with their CIs."""
    s = metrics["finetuned"]["setup"]
    lines = [f"held-out forecast: {s['windows']} windows (every non-overlapping test window) x {s['horizon']} "
             f"candles, {s['series']} series, {s['samples']} samples; close, returns vs the last context close",
             f"{'':15}{'MAE':>9}{'MASE':>7}{'CRPS':>9}{'WQL':>7}{'cov50':>7}{'cov80':>7}{'dir':>7}"]
    num = lambda v, fmt: format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))
    rows = [("finetuned", metrics["finetuned"]["model"])]
    if metrics.get("zero_shot"):
        rows.append(("zero-shot", metrics["zero_shot"]["model"]))
    rows.append(("persistence", metrics["finetuned"]["persistence"]))
    if "seasonal_naive" in metrics["finetuned"]:
        rows.append((f"seasonal({s['season']})", metrics["finetuned"]["seasonal_naive"]))
    for label, block in rows:
        o = block["overall"]
        lines.append(f"{label:15}{num(o['mae'], '9.5f')}{num(o.get('mase'), '7.3f')}{num(o['crps'], '9.5f')}"
                     f"{num(o['wql'], '7.3f')}{num(o.get('coverage_50'), '7.2f')}{num(o.get('coverage_80'), '7.2f')}"
                     f"{num(o.get('direction_accuracy'), '7.3f')}")
    d = metrics["finetuned"]["direction"]
    lines.append(f"dir = sign of the {d['horizon']}-bar move; coin 0.500, majority class {d['majority_class']:.3f}")
    ci = lambda c: f"{c['estimate']:+.5f} [{c['low']:+.5f}, {c['high']:+.5f}]"
    boot = metrics["finetuned"].get("bootstrap")
    if boot:
        lines.append(f"CRPS finetuned - persistence: {ci(boot['crps_minus_persistence'])} (95% CI)")
    diff = metrics.get("finetuned_vs_zero_shot")
    if diff and diff.get("bootstrap"):
        lines.append(f"CRPS finetuned - zero-shot:   {ci(diff['bootstrap']['crps'])} (95% CI; < 0 = finetuning "
                     f"helped; finetuned better on {diff['windows_finetuned_better_crps']:.0%} of windows)")
    return "\n".join(lines)


def evaluate_held_out(cfg: CsvFinetuneConfig, finetuned: KronosPredictor, windows: HeldOutWindows,
                      zero_shot: KronosPredictor | None = None, season: int | None = None) -> tuple[dict, np.ndarray]:
    """Sample, score and compare; returns (metrics dict for metrics.json, finetuned paths (W, S, P, 6)).
    `season`: of the seasonal-naive baseline (None = none)."""
    f = cfg.forecast
    x_stamps, y_stamps = windows.stamps()
    sample = lambda p: sample_paths(p, windows.context, x_stamps, y_stamps, cfg.data.predict, f, f.batch_size)
    settings = ScoreSettings(season=season, n_boot=f.bootstrap_samples, block=f.bootstrap_block,
                             seed=f.seed)
    close = lambda paths: (paths[..., CLOSE], windows.actual[..., CLOSE], windows.context[:, -1, CLOSE],
                           windows.context[..., CLOSE], np.asarray(windows.names))
    paths = sample(finetuned)  # (W, S, P, 6)
    metrics = {"windows": len(windows), "horizon": cfg.data.predict, "series": sorted(set(windows.names)),
               "window_stride": f.window_stride or cfg.data.predict, "finetuned": score_forecasts(*close(paths),
                                                                                                  settings=settings),
               "zero_shot": None, "finetuned_vs_zero_shot": None,
               "candle_violations": candle_violations(*(paths[..., FEATURES.index(c)] for c in
                                                        ("open", "high", "low", "close", "volume")))}
    if zero_shot is not None:
        zs_paths = sample(zero_shot)
        metrics["zero_shot"] = score_forecasts(*close(zs_paths), settings=settings)
        metrics["finetuned_vs_zero_shot"] = paired_difference(paths, zs_paths, windows, settings)
    return metrics, paths


def _panels(names: list[str], past_ts, past_close, future_ts, paths, actual=None, max_panels: int = 4) -> list[Panel]:
    """One panel per series (its first window), at most `max_panels`."""
    firsts = [names.index(n) for n in dict.fromkeys(names)][:max_panels]
    return [Panel(f"{names[i]}: close from {future_ts[i][0]} to {future_ts[i][-1]}", past_ts[i], past_close[i],
                  future_ts[i], paths[i, :, :, CLOSE], None if actual is None else actual[i, :, CLOSE])
            for i in firsts]


def run_forecast(cfg: CsvFinetuneConfig, out_dir: Path | None = None) -> dict:
    """Score every held-out test window (and the zero-shot model); write metrics.json, forecast.csv and the plot."""
    if cfg.data.test_ratio <= 0:
        raise ValueError("data.test_ratio is 0: there is no held-out test split to forecast; set it > 0 "
                         "(and retrain, since the ratios move the split boundaries)")
    finetuned = finetuned_predictor(cfg)
    data = prepare_data(cfg.data, cfg.store_dir)  # the store training made (re-prepared if the files changed)
    windows = held_out_windows(data.splits["test"], cfg.data.lookback, cfg.data.predict,
                               cfg.forecast.window_stride, cfg.forecast.max_windows)
    first_series = pd.DatetimeIndex(np.asarray(data.panel.datetimes[data.panel.rows(0)]).astype("datetime64[ns]"))
    metrics, paths = evaluate_held_out(cfg, finetuned, windows, zero_shot_predictor(cfg),
                                       _season(cfg, first_series))

    out_dir = Path(out_dir) if out_dir is not None else cfg.base_dir / "forecast"
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(forecast_table(windows.names, windows.y_timestamps, paths, windows.actual), out_dir / "forecast.csv")
    tail = min(cfg.data.lookback, 3 * cfg.data.predict)
    plot_panels(_panels(windows.names, [ts[-tail:] for ts in windows.x_timestamps],
                        windows.context[:, -tail:, CLOSE], windows.y_timestamps, paths, windows.actual),
                out_dir / "forecast_vs_actual.png")
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def run_future(cfg: CsvFinetuneConfig, out_dir: Path | None = None) -> pd.DataFrame:
    """Forecast the `data.predict` candles after each series' last row; write forecast.csv and forecast.png."""
    finetuned = finetuned_predictor(cfg)
    panel = prepare_data(cfg.data, cfg.store_dir, with_splits=False).panel  # whole series, no split needed
    lookback, predict = cfg.data.lookback, cfg.data.predict
    lengths = panel.lengths()
    short = [name for name, n in zip(panel.names, lengths.tolist()) if n < lookback]
    if short:
        raise ValueError(f"series shorter than data.lookback={lookback} rows cannot be forecast: {short}; lower "
                         "data.lookback or remove them")
    trading_dates = read_calendar(cfg.forecast.calendar) if cfg.forecast.calendar else None
    names = list(panel.names)
    ends = np.asarray(panel.offsets[1:], dtype=np.int64)  # (S,) one past each series' last column
    cols = ends[:, None] - lookback + np.arange(lookback, dtype=np.int64)  # (S, L) the last lookback columns
    when = lambda s: pd.DatetimeIndex(np.asarray(panel.datetimes[panel.rows(s)]).astype("datetime64[ns]"))
    past_ts = [when(s)[-lookback:] for s in range(len(names))]
    future_ts = [future_timestamps(when(s), predict, trading_dates, name) for s, name in enumerate(names)]
    context = np.moveaxis(np.asarray(panel.features[:, cols], dtype=np.float64), 0, -1)  # (S, L, 6)
    as_stamps = lambda stamps: np.stack([calc_time_stamps(ts).to_numpy(np.int64) for ts in stamps])
    paths = sample_paths(finetuned, context, as_stamps(past_ts), as_stamps(future_ts), predict, cfg.forecast,
                         cfg.forecast.batch_size)  # (N, S, P, 6)
    table = forecast_table(names, future_ts, paths).drop(columns="window")
    out_dir = Path(out_dir) if out_dir is not None else cfg.base_dir / "future"
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(table, out_dir / "forecast.csv")
    tail = min(lookback, 3 * predict)
    plot_panels(_panels(names, [ts[-tail:] for ts in past_ts], context[:, -tail:, CLOSE], future_ts, paths),
                out_dir / "forecast.png")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--future", action="store_true",
                        help="forecast the data.predict candles after each series' last row instead of scoring")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    cfg = csv_config.load(args.config, args.set)
    if args.future:
        table = run_future(cfg)
        print(f"future forecast: {table['series'].nunique()} series x {cfg.data.predict} candles, from "
              f"{table['timestamps'].min()} to {table['timestamps'].max()}")
        print(f"written: {cfg.base_dir / 'future'}/{{forecast.csv, forecast.png}}")
        return 0
    metrics = run_forecast(cfg)
    print(format_report(metrics))
    print(f"written: {cfg.base_dir / 'forecast'}/{{metrics.json, forecast.csv, forecast_vs_actual.png}}")
    return 0


if __name__ == "__main__":
    from finetune.cli import run_script  # clean errors, exit codes, --debug, --help-config, --print-config

    sys.exit(run_script("forecast", main))
