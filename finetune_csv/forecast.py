"""Forecast with a finetuned CSV run: score every held-out test window, or forecast past the end of the data.

    kronos forecast --config configs/csv_demo.yaml [--future] [--set forecast.sample_count=50]"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import itertools
import logging
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from finetune.evaluation.forecast_scores import (
    ScoreSettings,
    coverage_test,
    infer_season,
    interval_coverage,
    score_forecasts,
)
from finetune.evaluation.held_out import HeldOutWindows, held_out_windows, sample_paths, window_crps_mae
from finetune.evaluation.report import write_report
from finetune.evaluation.statistics import session_test
from finetune.utils.cli_args import add_config_args, parse_config_args
from finetune.utils.config_utils import config_to_dict
from finetune.utils.errors import setup_logging
from finetune.utils.fingerprint import digest
from finetune.utils.ledger import stage_status
from finetune.utils.plots import Panel, plot_panels, stamp_text
from finetune.utils.safety import LOCK_NAME, GracefulStop, RunLock, read_holder
from finetune.utils.windows import PanelSegments
from finetune_csv.config import CsvFinetuneConfig, best_dir, load
from finetune_csv.journal import append_forecasts, journal_records
from finetune_csv.pipeline import CsvPipeline
from finetune_csv.prepare import StoreSettings, prepare_data
from finetune_csv.sources import list_sources, source_fingerprint
from finetune_csv.splits import held_out_from
from model import KronosPredictor, KronosTokenizer, adaptive
from model.calendar import TradingCalendar
from model.calibration import apply_calibration, decoding_changes, fit_windows, write_calibration
from model.config import Window
from model.errors import ConfigError, DataError, PathError, RefusedError
from model.features import BODY_RULES, CLOSE, FEATURES, PRICE_FEATURES, candle_faults, quantile_column
from model.fileio import atomic_dir, read_json_object, write_json
from model.hub import weights_fingerprint
from model.predictor import (
    PREDICTOR_INFO_NAME,
    load_pretrained_pair,
    load_trained_pair,
    read_predictor_info,
    tokenizer_source,
)


def candle_violations(open_: np.ndarray, high: np.ndarray, low: np.ndarray, close: np.ndarray,
                      volume: np.ndarray) -> dict[str, float]:
    """Share of generated candles breaking each wick rule of `model.features.candle_faults` (their one home: high
    below max(open, close), low above min(open, close)) or with a negative volume, and any of them: the tokenizer
    decodes each feature independently, so nothing forces a candle to respect them."""
    o, h, l, c, v = (np.asarray(a, dtype=np.float64).ravel() for a in (open_, high, low, close, volume))
    if not (len(o) == len(h) == len(l) == len(c) == len(v)) or len(o) == 0:
        raise ValueError("candle_violations needs equally long, non-empty open/high/low/close/volume")
    broken = {(f, rule): rows for f, rows, rule in candle_faults(np.stack([o, h, l, c], axis=1))}
    bad_high, bad_low = (broken.get((f, BODY_RULES[f]), np.zeros(len(o), bool)) for f in ("high", "low"))
    bad_volume = v < 0
    return {"high_below_body": float(bad_high.mean()), "low_above_body": float(bad_low.mean()),
            "negative_volume": float(bad_volume.mean()), "any": float((bad_high | bad_low | bad_volume).mean())}


def repair_candles(paths: np.ndarray) -> np.ndarray:
    """Valid candles from sampled ones (..., 6): high = max(open, high, close), low = min(open, low, close), volume
    and amount at least 0."""
    o, h, l, c = (paths[..., FEATURES.index(k)] for k in ("open", "high", "low", "close"))
    out = paths.copy()
    out[..., FEATURES.index("high")] = np.maximum(np.maximum(o, h), c)
    out[..., FEATURES.index("low")] = np.minimum(np.minimum(o, l), c)
    out[..., 4:] = np.maximum(out[..., 4:], 0.0)
    return out


def ensemble_paths(finetuned: np.ndarray, zero_shot: np.ndarray, weight: float) -> np.ndarray:
    """The `ensemble` candidate: the first round(weight * S) of the finetuned model's paths (exchangeable draws: the
    first are as good as any), the rest zero-shot; paths (W, S, H) or (W, S, H, F) of the same windows -> same shape."""
    if finetuned.shape != zero_shot.shape:
        raise ValueError(f"ensemble needs equally shaped paths, got {finetuned.shape} and {zero_shot.shape}")
    k = round(weight * finetuned.shape[1])
    return np.concatenate([finetuned[:, :k], zero_shot[:, k:]], axis=1)


def read_calendar(path: str | Path) -> pd.DatetimeIndex:
    """Trading dates (normalised, sorted, unique) from the first column of a CSV file (`forecast.calendar`)."""
    try:  # an empty or unparsable file is a pandas ValueError too
        dates = pd.DatetimeIndex(pd.to_datetime(pd.read_csv(path).iloc[:, 0])).normalize()
    except (ValueError, TypeError, IndexError) as exc:
        raise DataError(f"forecast.calendar: the first column of {path} must hold dates ({exc})") from None
    if len(dates) == 0:
        raise DataError(f"forecast.calendar: {path} lists no dates")
    return dates.unique().sort_values()


log = logging.getLogger("finetune_csv.forecast")
TABLE_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)  # quantile columns of forecast.csv (the plot's bands + median)


def warn_if_unfinished(stage_dir: Path) -> None:
    """One warning when the predictor stage is running (its run.lock is held) or did not finish: its best model so
    far is what gets forecast, and may change."""
    lock = Path(stage_dir) / LOCK_NAME
    if lock.is_file():
        holder = read_holder(lock)
        alive = True  # another host's, or an unreadable, holder: assume it runs
        if holder.pid is not None and holder.host == socket.gethostname():
            try:
                os.kill(holder.pid, 0)
            except ProcessLookupError:
                alive = False  # a killed run's leftover lock
            except PermissionError:
                pass
        if alive:
            log.warning("the predictor stage in %s is still running (%s): forecasting its best model so far, which "
                        "may still change", stage_dir, holder.describe())
            return
    trained = any((Path(stage_dir) / name).exists() for name in ("checkpoints", "run_info.json", "metrics.jsonl"))
    if trained and stage_status(stage_dir) != "finished":  # not a best_model/ placed there by hand
        log.warning("the predictor stage in %s did not finish: forecasting its best model so far (resume the "
                    "training to finish it)", stage_dir)


def finetuned_predictor(cfg: CsvFinetuneConfig) -> tuple[KronosPredictor, dict | None]:
    """The run's best predictor with the tokenizer it was trained with (`load_trained_pair`: a swapped tokenizer is
    refused naming both fingerprints), and its stored calibration (None when there is none or forecast.calibrate is
    false); a clear error when there is no predictor."""
    predictor_dir = best_dir(cfg.predictor_dir)
    if not (predictor_dir / "config.json").is_file():
        raise PathError(f"no trained predictor in {predictor_dir}; run finetune_csv/train_sequential.py first")
    warn_if_unfinished(cfg.predictor_dir)
    current = CsvPipeline(cfg).tokenizer_source()[0]
    recorded = tokenizer_source(predictor_dir, read_predictor_info(predictor_dir))
    model, tokenizer, info = load_trained_pair(predictor_dir, None if recorded else current)
    if recorded and Path(recorded).resolve() != Path(current).resolve() and Path(current).is_dir() and \
            weights_fingerprint(KronosTokenizer.from_pretrained(current)) != weights_fingerprint(tokenizer):
        log.warning("the predictor in %s was trained with tokenizer %s, not with this run's %s: forecasting with the "
                    "former (retrain the predictor to use the latter)", predictor_dir, recorded, current)
    # The windows this forecast cuts must be the ones the predictor learned on (kronos_predictor.json records them).
    wrong = [f"{k}: is {now!r} but the predictor in {predictor_dir} was trained with {was!r}; set it back, or retrain"
             for k, was, now in cfg.data.window.differences(Window.from_saved(info), ("lookback", "clip"))]
    if wrong:
        raise ConfigError(wrong, "Invalid forecast configuration")
    calibration = info.get("calibration") if cfg.forecast.calibrate else None
    changed = decoding_changes(calibration, cfg.forecast.decoding()) if calibration is not None else []
    if changed:  # margins of other sampling would mis-state every band
        raise RefusedError(f"the calibration in {predictor_dir / PREDICTOR_INFO_NAME} was fitted with other forecast "
                           f"sampling ({', '.join(changed)}; T = forecast.temperature): set those forecast.* settings "
                           "back, or --set forecast.calibrate=false for the raw bands")
    horizons = len(calibration["margins"][0]) if calibration is not None else cfg.data.predict
    if horizons < cfg.data.predict:  # said before any sampling
        raise ConfigError([f"data.predict: is {cfg.data.predict} but the calibration in "
                           f"{predictor_dir / PREDICTOR_INFO_NAME} covers {horizons} horizons; set data.predict "
                           f"<= {horizons}, or --set forecast.calibrate=false for the raw bands"],
                          "Invalid forecast configuration")
    if cfg.forecast.calibrate and calibration is None and stage_status(cfg.predictor_dir) == "finished":
        log.warning("the predictor in %s finished but its bands were never calibrated (the run stopped before "
                    "calibrating): these bands are the raw samples'; run `kronos finetune` again with this config to "
                    "calibrate it", predictor_dir)
    elif cfg.forecast.calibrate and calibration is None:
        log.info("no calibration stored in %s: the bands are the raw samples' (train with forecast.calibrate: true "
                 "to fit one)", predictor_dir / PREDICTOR_INFO_NAME)
    return KronosPredictor.from_models(model, tokenizer, window=cfg.data.window), calibration


SPLIT_KEYS = ("train_ratio", "val_ratio", "test_ratio", "split", "train_end", "val_end")


def run_folders(cfg: CsvFinetuneConfig, out_dir: Path | None, name: str) -> tuple[Path, Path, dict]:
    """(data store, output folder, provenance) of a forecast: the run's (`out_dir` or <base_dir>/<name>) with the
    data and the data.* settings the run was trained with (its run_info.json: files by sha256, columns, split);
    otherwise folders keyed by what differs beside them, never over the run's own (the log says what differs). A
    `future` forecast of new bars on the run's settings stays in <name>/: the newest forecast is always there."""
    out_dir = Path(out_dir) if out_dir is not None else cfg.base_dir / name
    info = cfg.predictor_dir / "run_info.json"
    run = read_json_object(info) if info.is_file() else {}
    files = [{"path": str(f["path"]), "sha256": f["sha256"]} for f in map(source_fingerprint,
                                                                          list_sources(cfg.data.path))]
    flat = lambda d: {f"{k}.{s}" if s else k: x for k, v in d.items()  # noqa: E731 - data.columns.<field>
                      for s, x in (v.items() if isinstance(v, dict) else [("", v)])}
    made, now = flat((run.get("config") or {}).get("data") or {}), flat(config_to_dict(cfg.data))
    keys = [f.name for f in dataclasses.fields(StoreSettings)] + list(SPLIT_KEYS if name != "future" else ())
    changed = [k for k in now if k.split(".")[0] in keys and k in made and made[k] != now[k]]
    differs = [f"data.{k}: {made[k]!r} -> {now[k]!r}" for k in changed]
    recorded = sorted(f["sha256"] for f in (run.get("data") or {}).get("files") or [])
    ours = sorted(f["sha256"] for f in files)
    new_data = bool(recorded) and recorded != ours
    key = digest([differs, ours if name != "future" else []])[:12]
    if new_data or set(changed) - set(SPLIT_KEYS):  # never re-prepare the run's own store in place
        store_dir = cfg.store_dir.with_name(f"{cfg.store_dir.name}_{key}")
    else:
        store_dir = cfg.store_dir
    if new_data:
        differs.append(f"data files: {len(files)} file(s) whose content is not that of the {len(recorded)} the run "
                       "was trained on")
    beside = bool(changed) or (new_data and name != "future")  # new bars are what a future forecast is for
    out_dir = out_dir.with_name(f"{out_dir.name}_{key}") if beside else out_dir
    if differs:
        log.warning("forecasting with other data or settings than the run in %s was trained with (%s): writing %s%s",
                    cfg.predictor_dir, "; ".join(differs), out_dir, ", beside the run's own outputs" if beside else "")
    return store_dir, out_dir, {"data": {"files": files, "store": str(store_dir)}, "differs_from_run": differs}


def check_memory(cfg: CsvFinetuneConfig, windows: int, copies: int) -> None:
    """Refuse, before sampling, a forecast.sample_count whose paths cannot fit in memory: `copies` arrays of
    (windows, S, predict, 6) float64, plus one batch's contexts repeated S times."""
    f, d = cfg.forecast, cfg.data
    needed = 48 * f.sample_count * (copies * windows * d.predict + min(f.batch_size, windows) * d.window.size)
    sysconf = getattr(os, "sysconf", None)  # POSIX; elsewhere the allocation itself fails
    total = sysconf("SC_PHYS_PAGES") * sysconf("SC_PAGE_SIZE") if sysconf else None
    if total is not None and needed > total:
        raise ConfigError([f"forecast.sample_count: {f.sample_count} sample paths of {windows} window(s) need about "
                           f"{needed / 2**30:.1f} GiB, more than this machine's {total / 2**30:.1f} GiB of memory; "
                           "lower it (or forecast.max_windows)"], "Invalid forecast configuration")


def finish_paths(paths: np.ndarray, calibration: dict | None, last: np.ndarray, repair: bool) -> np.ndarray:
    """Sampled paths (W, S, P, 6) as the forecast reports them: calibrated (the prices of each candle scaled by
    its calibrated / raw close, so candles keep their shape) and, with `repair`, made valid candles."""
    if calibration is not None:
        close = paths[..., CLOSE]  # (W, S, P)
        ratio = apply_calibration(calibration, close, last) / close
        paths = paths.copy()
        for f in PRICE_FEATURES:
            paths[..., FEATURES.index(f)] *= ratio
    return repair_candles(paths) if repair else paths


def zero_shot_predictor(cfg: CsvFinetuneConfig) -> KronosPredictor | None:
    """The starting model (model.pretrained_predictor + its tokenizer), or None with one log line when there is none
    or it cannot be loaded (e.g. a Hub id without network)."""
    m = cfg.model
    if not cfg.forecast.compare_pretrained or m.pretrained_predictor is None:
        return None
    tokenizer_src = m.pretrained_tokenizer or CsvPipeline(cfg).tokenizer_source()[0]
    try:
        pair = load_pretrained_pair(m.pretrained_predictor, tokenizer_src)
    except Exception as exc:  # noqa: BLE001 - any load failure (network, files, shapes) only skips the comparison
        log.warning("zero-shot comparison skipped: cannot load model.pretrained_predictor=%s with tokenizer %s (%s)",
                    m.pretrained_predictor, tokenizer_src, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    # The zero-shot side must be the start the run was finetuned from (overwritten in place or pointed elsewhere, the
    # comparison would score other weights); run_info.json records it (older runs: nothing to compare).
    for model, stage, key in ((pair[0], cfg.predictor_dir, "predictor"), (pair[1], cfg.tokenizer_dir, "tokenizer")):
        info = stage / "run_info.json"
        was = (read_json_object(info) if info.is_file() else {}).get("start_fingerprint")
        if was and (key == "predictor" or m.pretrained_tokenizer) and was != weights_fingerprint(model):
            raise DataError(f"model.pretrained_{key}: its weights are not the ones the run in {stage} was finetuned "
                            f"from (sha256 {was[:12]} -> {weights_fingerprint(model)[:12]}), so the zero-shot "
                            "comparison would score other weights; point it at the run's start, retrain "
                            "(`kronos finetune --skip-existing`) or set forecast.compare_pretrained: false")
    return KronosPredictor.from_models(*pair, window=cfg.data.window)


def _season(cfg: CsvFinetuneConfig, panel) -> dict[str, int] | None:
    """The seasonal-naive season of each series: forecast.season, else inferred from its own bar times (bars per day
    intraday, 5 for daily bars); None (logged, naming the series) when one cannot be inferred or exceeds lookback."""
    seasons = {}
    for s, name in enumerate(panel.names):
        try:
            seasons[name] = cfg.forecast.season or infer_season(np.asarray(panel.datetimes[panel.rows(s)]))
        except ValueError as exc:
            log.info("no seasonal-naive baseline: %s: %s (set forecast.season)", name, exc)
            return None
        if seasons[name] > cfg.data.lookback:
            log.info("no seasonal-naive baseline: the season of %s (%d bars) is longer than data.lookback (%d); "
                     "set forecast.season", name, seasons[name], cfg.data.lookback)
            return None
    return seasons


def paired_difference(candidate: np.ndarray, zero_shot: np.ndarray, windows: HeldOutWindows,
                      settings: ScoreSettings) -> dict:
    """Candidate (finetuned, ensemble) - zero-shot CRPS and MAE per window (same windows), each with the HAC-t interval
    of `session_test` (windows of all series on one date or trading session are one observation; too few
    independent blocks: no interval); < 0 = candidate better. `candidate`, `zero_shot`: sample paths (W, S, P, 6)."""
    crps_f, mae_f = window_crps_mae(candidate, windows)
    crps_z, mae_z = window_crps_mae(zero_shot, windows)
    out = {"crps": crps_f.mean() - crps_z.mean(), "mae": mae_f.mean() - mae_z.mean(),
           "windows_finetuned_better_crps": float((crps_f < crps_z).mean())}
    test = lambda d, what: session_test(d, pd.to_datetime(windows.dates()), settings.min_block - 1, what=what)
    out["test"] = {"crps": test(crps_f - crps_z, "CRPS - zero-shot"), "mae": test(mae_f - mae_z, "MAE - zero-shot")}
    names, d = np.asarray(windows.names), crps_f - crps_z  # per series: one group cannot carry the headline unseen
    out["per_series"] = {n: {k: t[k] for k in ("mean", "windows", "ci_low", "ci_high", "verdict")} for n in
                         sorted(set(names)) for t in [session_test(d[names == n], pd.to_datetime(windows.dates())[
                             names == n], settings.min_block - 1, what="CRPS - zero-shot")]}
    return out


def ranking(metrics: dict) -> str:
    """The verdict line: every scored forecaster ranked by mean CRPS, the best named with its interval against the
    runner-up it was compared with (the finetuned model against each baseline and zero-shot)."""
    ft = metrics["finetuned"]
    overall = {k: (metrics.get(k) or {}).get("model", ft.get(k, {})).get("overall", {}) for k in
               ("finetuned", "zero_shot", "ensemble", "persistence", "empirical", "seasonal_naive")}
    crps = {k: o.get("crps") for k, o in overall.items()}  # the fair CRPS: no penalty for drawing fewer samples
    order = sorted((k for k in crps if crps[k] is not None), key=crps.get)
    tests = {frozenset(("finetuned", k)): t for k, t in (ft.get("versus") or {}).items()}
    tests |= {frozenset((k, "zero_shot")): metrics[f"{k}_vs_zero_shot"]["test"]["crps"]
              for k in ("finetuned", "ensemble") if metrics.get(f"{k}_vs_zero_shot")}
    best = order[0]  # its interval: against the next in the ranking that it was compared with (signs as printed)
    rival = next((o for o in order[1:] if frozenset((best, o)) in tests), None)
    name = lambda k: k.replace("_", "-")  # noqa: E731
    bands = (metrics.get("finetuned_vs_zero_shot") or {}).get("bands")  # like with like: which bands both had
    same = f" ({bands} bands, both)" if bands and {best, rival} == {"finetuned", "zero_shot"} else ""
    vs = f"; against {name(rival)}{same}: {tests[frozenset((best, rival))]['reason']}" if rival else ""
    return f"best by CRPS: {name(best)} (" + " < ".join(f"{name(k)} {crps[k]:.5f} [S={overall[k].get('samples')}]"
                                                         for k in order) + ")" + vs


def forecast_table(names: list[str], stamps: list[pd.DatetimeIndex], paths: np.ndarray,
                   actual: np.ndarray | None = None, raw: np.ndarray | None = None) -> pd.DataFrame:
    """Long table, one row per series (window) and forecast bar: mean `pred_<f>` and quantiles `<f>_q<percent>`
    (PLAN interface 3, e.g. `close_q10`) of each feature over the sample paths `(W, S, P, 6)`, the same of the
    uncalibrated paths `raw (W, S, P, 6)` as `raw_<f>_q<percent>` when given, plus `actual_<f>` when the actual
    candles `(W, P, 6)` are known."""
    mean = paths.mean(axis=1)  # (W, P, 6)
    quant = {pre: np.quantile(p, TABLE_QUANTILES, axis=1) for pre, p in (("", paths), ("raw_", raw))
             if p is not None}  # {prefix: (Q, W, P, 6)}
    parts = []
    for i, (name, ts) in enumerate(zip(names, stamps)):
        part = pd.DataFrame({"window": i, "series": name, "timestamps": ts})
        for j, f in enumerate(FEATURES):
            part[f"pred_{f}"] = mean[i, :, j]
            for (pre, qs), (k, q) in itertools.product(quant.items(), enumerate(TABLE_QUANTILES)):
                part[pre + quantile_column(f, q)] = qs[k, i, :, j]
            if actual is not None:
                part[f"actual_{f}"] = actual[i, :, j]
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def format_report(metrics: dict) -> str:
    """One short table: each candidate's and baseline's headline scores, then the paired differences with their CIs,
    the calibration's coverage and the share of invalid sampled candles."""
    s = metrics["finetuned"]["setup"]
    lines = [f"held-out forecast: {s['windows']} windows (every non-overlapping test window) x {s['horizon']} "
             f"candles, {s['series']} series ({', '.join(metrics['series'])}), {s['samples']} samples; close, returns "
             "vs the last context close" + (f"; no test window: {', '.join(metrics['series_without_test_windows'])}"
                                            if metrics.get("series_without_test_windows") else ""),
             f"{'':15}{'MAE':>9}{'MASE':>7}{'CRPS':>9}{'WQL':>7}{'cov50':>7}{'cov80':>7}{'dir':>7}"]
    num = lambda v, fmt: format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))
    rows = [(name.replace("_", "-"), metrics[name]["model"]) for name in ("finetuned", "zero_shot", "ensemble")
            if metrics.get(name)]
    rows += [(name, metrics["finetuned"][name]) for name in ("persistence", "empirical")
             if name in metrics["finetuned"]]
    if "seasonal_naive" in metrics["finetuned"]:
        season = s["season"] if isinstance(s["season"], int) else "per series"  # {series: season} when they differ
        rows.append((f"seasonal({season})", metrics["finetuned"]["seasonal_naive"]))
    for label, block in rows:
        o = block["overall"]
        lines.append(f"{label:15}{num(o['mae'], '9.5f')}{num(o.get('mase'), '7.3f')}{num(o['crps'], '9.5f')}"
                     f"{num(o['wql'], '7.3f')}{num(o.get('coverage_50'), '7.2f')}{num(o.get('coverage_80'), '7.2f')}"
                     f"{num(o.get('direction_accuracy'), '7.3f')}")
    d = metrics["finetuned"]["direction"]
    lines.append(f"dir = sign of the {d['horizon']}-bar move; coin 0.500, majority class {d['majority_class']:.3f}")
    for name, test in (metrics["finetuned"].get("versus") or {}).items():
        lines.append(f"finetuned vs {name}: {test['reason']}")
    for name in ("finetuned", "finetuned_raw", "ensemble"):
        diff = metrics.get(f"{name}_vs_zero_shot")
        if diff:
            bands = f"{name.removesuffix('_raw')} vs zero-shot" + (f" ({diff['bands']} bands, both)" if
                                                                    diff.get("bands") else "")
            lines.append(f"{bands}: {diff['test']['crps']['reason']} (< 0 = better; better on "
                         f"{diff['windows_finetuned_better_crps']:.0%} of windows)")
    per = (metrics.get("finetuned_vs_zero_shot") or {}).get("per_series")
    if per:  # the series that gained most and least: whether one group carries the panel's number
        ci = lambda r: f", [{r['ci_low']:+.3g}, {r['ci_high']:+.3g}]" if r["ci_low"] is not None else ""  # noqa: E731
        say = lambda n: f"{n} {per[n]['mean']:+.4f} ({per[n]['windows']} windows{ci(per[n])})"  # noqa: E731
        order = sorted(per, key=lambda n: per[n]["mean"])
        lines.append(f"finetuned vs zero-shot by series (CRPS): better on {sum(per[n]['mean'] < 0 for n in per)} "
                     f"of {len(per)}; most gained {say(order[0])}, least {say(order[-1])} (all: metrics.json)")
    lines.append(ranking(metrics))
    cal = metrics.get("calibration")
    if cal:
        lines.append(f"calibrated bands (fitted on {cal['fitted_on_windows']} validation windows), held-out coverage "
                     f"raw -> calibrated: 50% {cal['cov50_raw']:.2f} -> {cal['cov50_calibrated']:.2f}, 80% "
                     f"{cal['cov80_raw']:.2f} -> {cal['cov80_calibrated']:.2f} (nominal 0.50 / 0.80)"
                     + (f"; too few validation windows for the {cal['too_few_windows']} bands"
                        if cal.get("too_few_windows") else ""))
        lines += [cal[f"test_{p}"]["reason"] for p in (50, 80)]
        off = [f"{p}%" for p in (50, 80) if cal[f"test_{p}"]["verdict"] != "no_evidence"]
        if off:
            lines.append(f"calibrated coverage off nominal at {', '.join(off)} (its interval excludes 0): the "
                         "stored calibration does not fit this data; refit it, or set forecast.calibrate: false")
    v = metrics["candle_violations"]
    lines.append(f"invalid sampled candles: {v['any']:.1%} (high below the body {v['high_below_body']:.1%}, low above "
                 f"it {v['low_above_body']:.1%}, negative volume {v['negative_volume']:.1%}); "
                 + ("repaired (forecast.repair_candles: true)" if metrics["candles_repaired"] else
                    "kept as sampled (forecast.repair_candles: true repairs them)"))
    return "\n".join(lines)


def evaluate_held_out(cfg: CsvFinetuneConfig, finetuned: KronosPredictor, windows: HeldOutWindows,
                      zero_shot: KronosPredictor | None = None, season: int | dict[str, int] | None = None,
                      calibration: dict | None = None, zs_calibration: dict | None = None
                      ) -> tuple[dict, np.ndarray, np.ndarray | None]:
    """Sample, score and compare; returns (metrics dict for metrics.json, finetuned paths (W, S, P, 6) as reported:
    calibrated and, with forecast.repair_candles, repaired; the same uncalibrated when calibrated, else None).
    `season`: of the seasonal-naive baseline (None = none);
    `calibration`: the predictor's stored calibration (None = raw samples); `windows.history`: closes before each
    window for the `empirical` baseline (None or too short for one horizon: no empirical baseline, logged)."""
    f, horizon = cfg.forecast, cfg.data.predict
    x_stamps, y_stamps = windows.stamps()
    sample = lambda p: sample_paths(p, windows.context, x_stamps, y_stamps, horizon, f, f.batch_size)
    settings = ScoreSettings(season=season, min_block=-(-horizon // (f.window_stride or horizon)),
                             empirical_window=f.empirical_window)
    history = windows.history
    if history is None or history.shape[1] < horizon + 2:
        log.info("no empirical baseline: fewer than %d bars of history before some test window", horizon + 2)
        history = None
    last = windows.context[:, -1, CLOSE]  # (W,)
    score = lambda paths: score_forecasts(paths[..., CLOSE], windows.actual[..., CLOSE], last,
                                          windows.context[..., CLOSE], np.asarray(windows.names), settings,
                                          history, pd.to_datetime(windows.dates()).to_numpy())
    raw = sample(finetuned)  # (W, S, P, 6)
    plain = finish_paths(raw, None, last, f.repair_candles)  # uncalibrated, as reported
    paths = plain if calibration is None else finish_paths(raw, calibration, last, f.repair_candles)
    # adaptive: each window calibrated with the margins tracked on the outcomes published by its origin
    adapt = lambda cal, r, save=None: np.stack([finish_paths(r[w : w + 1], c, last[w : w + 1], f.repair_candles)[0]
                                                for w, c in enumerate(adaptive_held_out(
                                                    cal, r[..., CLOSE], windows, f.per_series, save)["per_window"])])
    adaptive_on = calibration is not None and f.calibration_method == "adaptive"
    if adaptive_on:
        split_paths, paths = paths, adapt(calibration, raw, best_dir(cfg.predictor_dir) / PREDICTOR_INFO_NAME)
    metrics = {"windows": len(windows), "horizon": horizon, "series": sorted(set(windows.names)),
               "window_stride": f.window_stride or horizon, "finetuned": score(paths),
               "zero_shot": None, "finetuned_vs_zero_shot": None, "ensemble": None, "ensemble_vs_zero_shot": None,
               "calibration": None, "candles_repaired": f.repair_candles,
               "candle_violations": candle_violations(*np.moveaxis(raw[..., :5], -1, 0))}  # open .. volume
    if calibration is not None:  # coverage of the close before / after, on the test windows (out of sample)
        obs = windows.actual[..., CLOSE] / last[:, None] - 1.0  # (W, P)
        cover = lambda p, level: interval_coverage(obs, np.moveaxis(p[..., CLOSE] / last[:, None, None] - 1, 1, -1),
                                                   level)  # (W, P)
        metrics["calibration"] = {f"cov{p}_{k}": cover(b, p / 100).mean()
                                  for k, b in (("raw", raw), ("calibrated", paths)) for p in (50, 80)}
        metrics["calibration"] |= {"method": calibration.get("method"), "fitted_on_windows": calibration.get("windows"),
                                   "too_few_windows": calibration.get("too_few_windows", [])}
        bands = {"raw": raw, "calibrated": paths} | ({"split": split_paths} if adaptive_on else {})
        stats = {k: band_stats(p[..., CLOSE], windows.actual[..., CLOSE], last) for k, p in bands.items()}
        metrics["calibration"] |= band_quality({k: v[0] for k, v in stats.items()}, {k: v[1] for k, v in stats.items()},
                                               realised_vol(windows.actual[..., CLOSE], last), windows.dates())
        if adaptive_on:
            metrics["calibration"] |= {"method": "adaptive", "cov80_split": cover(split_paths, 0.8).mean()}
        metrics["calibration"] |= {f"test_{p}": coverage_test(cover(paths, p / 100), pd.to_datetime(windows.dates()),
                                                              p / 100, settings.min_block - 1) for p in (50, 80)}
    if zero_shot is not None:  # like with like: both calibrated (zs_calibration), else both raw
        zs_raw = sample(zero_shot)
        zs_plain = finish_paths(zs_raw, None, last, f.repair_candles)
        both = calibration is not None and zs_calibration is not None
        zs_paths = zs_plain if not both else adapt(zs_calibration, zs_raw) if adaptive_on else \
            finish_paths(zs_raw, zs_calibration, last, f.repair_candles)
        ft_paths = paths if calibration is None or both else plain
        ens_paths = ensemble_paths(paths, zs_paths, f.ensemble_weight)
        metrics["zero_shot"], metrics["ensemble"] = score(zs_paths), score(ens_paths)
        metrics["finetuned_vs_zero_shot"] = paired_difference(ft_paths, zs_paths, windows, settings)
        metrics["finetuned_vs_zero_shot"]["bands"] = "calibrated" if both else "raw"
        if both:
            metrics["finetuned_raw_vs_zero_shot"] = paired_difference(plain, zs_plain, windows, settings) | {
                "bands": "raw"}
        metrics["ensemble_vs_zero_shot"] = paired_difference(ens_paths, zs_paths, windows, settings)
        metrics["ensemble"]["weight"] = f.ensemble_weight
    return metrics, paths, None if calibration is None else plain


def adaptive_held_out(calibration: dict, raw: np.ndarray, windows: HeldOutWindows, per_series: bool,
                      save: Path | None = None) -> dict:
    """The adaptive calibration of held-out windows (`kronos forecast`, each walk-forward fold): tracked from the split
    margins on the outcomes published by each window's origin (`model.adaptive.replay`) from the sampled closes
    `raw (W, S, P)`; the end state saved beside the margins in `save` (kronos_predictor.json), so --future continues
    from it. Returns the calibration with "per_window" [calibration of window w]."""
    last = windows.context[:, -1, CLOSE]
    with np.errstate(divide="ignore", invalid="ignore"):
        quant = np.quantile(np.log(raw / last[:, None, None]), adaptive.SCORE_LEVELS, axis=1)  # (Q, W, P)
        scores = adaptive.band_scores(np.moveaxis(quant, 0, 1), np.log(windows.actual[..., CLOSE] / last[:, None]))
    names = list(windows.names)
    split = {k: v for k, v in calibration.items() if k != "adaptive"}
    state = adaptive.start_state(split, sorted(set(names)) if per_series else None)
    origins = pd.to_datetime(windows.dates()).to_numpy()
    arrivals = np.stack([pd.DatetimeIndex(ts).to_numpy() for ts in windows.y_timestamps])  # (W, P)
    margins = adaptive.replay(state, np.nan_to_num(scores, nan=0.0), origins, arrivals, names)
    if save is not None:
        write_calibration(save, {**split, "adaptive": state})
    return {**split, "adaptive": state, "per_window": [adaptive.with_margins(split, m) for m in margins]}


def band_stats(close: np.ndarray, actual: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per window (W,): the 80% coverage of sampled closes (W, S, P) against the actual ones (W, P), and the mean width
    of that central band in return units (vs the last context close (W,))."""
    lo, hi = np.quantile(close / last[:, None, None], [0.1, 0.9], axis=1)  # (W, P) each
    y = actual / last[:, None]
    return ((y >= lo) & (y <= hi)).mean(axis=1), (hi - lo).mean(axis=1)


def realised_vol(actual: np.ndarray, last: np.ndarray) -> np.ndarray:
    """(W,) mean absolute log return of each window's actual closes (W, P), from its last context close (W,)."""
    return np.abs(np.diff(np.log(np.c_[last, actual]), axis=1)).mean(axis=1)


def band_quality(cov80: dict[str, np.ndarray], width80: dict[str, np.ndarray], vol: np.ndarray, when) -> dict:
    """metrics' band fields from per-window (W,) 80% coverage and width of each band ("raw", "calibrated", and
    "split" beside adaptive ones), realised volatility and window times `when`: mean widths, the worst coverage over
    50 consecutive windows in time order, coverage per tercile of volatility (low, mid, high), and that rolling
    coverage over time for the page. The one home of these numbers (kronos forecast, walk-forward, tune)."""
    when = pd.to_datetime(np.asarray(when)).to_numpy()
    order = np.argsort(when, kind="stable")
    n = min(50, len(order))
    roll = {k: np.convolve(np.asarray(v, dtype=np.float64)[order], np.ones(n) / n, "valid") for k, v in cov80.items()}
    tercile = np.searchsorted(np.quantile(vol, [1 / 3, 2 / 3]), vol, side="right")
    by_vol = lambda c: [float(c[tercile == k].mean()) if (tercile == k).any() else None for k in range(3)]  # noqa: E731
    keep = np.unique(np.linspace(0, len(order) - n, min(400, len(order) - n + 1)).round().astype(int))
    out = {f"width80_{k}": float(np.mean(v)) for k, v in width80.items()}
    return out | {"cov80_rolling_worst": float(roll["calibrated"].min()), "cov80_rolling_worst_raw":
                  float(roll["raw"].min()), "cov80_by_volatility": by_vol(np.asarray(cov80["calibrated"])),
                  "cov80_by_volatility_raw": by_vol(np.asarray(cov80["raw"])), "cov80_over_time": {
                      "window": n, "time": [str(pd.Timestamp(when[order][n - 1 + i])) for i in keep],
                      **{k: [float(x) for x in r[keep]] for k, r in roll.items()}}}


def _panels(names: list[str], past_ts, past_close, future_ts, paths, actual=None, max_panels: int = 4) -> list[Panel]:
    """One panel per series (its first window), at most `max_panels`."""
    firsts = [names.index(n) for n in dict.fromkeys(names)][:max_panels]
    text = lambda i, k: stamp_text(future_ts[i][k], past_ts[i].append(future_ts[i]), "%Y-%m-%d %H:%M")
    return [Panel(f"{names[i]}: close from {text(i, 0)} to {text(i, -1)}", past_ts[i], past_close[i], future_ts[i],
                  paths[i, :, :, CLOSE], None if actual is None else actual[i, :, CLOSE]) for i in firsts]


@contextlib.contextmanager
def output_folder(out_dir: Path) -> Iterator[None]:
    """Hold the lock of a forecast's output folder (`.<name>.lock` beside it: the folder itself is swapped whole);
    what a killed forecast left beside it (`.<name>.*.tmp`) is removed first."""
    with RunLock(out_dir.parent, name=f".{out_dir.name}.lock", key="paths.base_dir"):
        for p in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
        yield


def write_outputs(cfg: CsvFinetuneConfig, out_dir: Path, files: dict, png: str, names: list[str], past_ts,
                  context: np.ndarray, future_ts, paths: np.ndarray, actual: np.ndarray | None = None) -> None:
    """The whole folder, swapped in at once with its SHA256SUMS (no reader or kill sees one forecast's file beside
    another's): `files` (forecast.csv: a table, *.json: data), the plot `png` of the last min(lookback, 3 x
    predict) context bars (W, L, 6) and the paths, and the page (report.html with its context.csv)."""
    tail = min(cfg.data.lookback, 3 * cfg.data.predict)
    with atomic_dir(out_dir, sealed=True) as tmp:
        for name, data in files.items():
            _ = data.to_csv(tmp / name, index=False) if name.endswith(".csv") else write_json(tmp / name, data)
        plot_panels(_panels(names, [ts[-tail:] for ts in past_ts], context[:, -tail:, CLOSE], future_ts, paths,
                            actual), tmp / png)
        write_report(tmp, (names, past_ts, context), cfg.data.predict, shown=out_dir)  # report.html, context.csv


def provenance(cfg: CsvFinetuneConfig, command: str, predictor: KronosPredictor, made: dict) -> dict:
    """forecast.json: what made the forecast (the models' weight hashes, the data files' sha256, every setting)."""
    return {"command": command, "written": pd.Timestamp.now(tz="UTC").isoformat(timespec="seconds"),
            "model": {"folder": str(best_dir(cfg.predictor_dir)), "predictor_sha256": weights_fingerprint(
                predictor.model), "tokenizer_sha256": weights_fingerprint(predictor.tokenizer)}, **made,
            "settings": config_to_dict(cfg)}


def run_forecast(cfg: CsvFinetuneConfig, out_dir: Path | None = None, folders: tuple | None = None) -> dict:
    """Score every held-out test window (and the zero-shot model); write metrics.json, forecast.csv, forecast.json
    and the plot (`folders`: `run_folders`' answer, when the caller asked already)."""
    d = cfg.data
    no_test = d.val_end is None if d.train_end else d.test_ratio <= 0  # a date split's test starts at val_end
    if no_test:
        raise ConfigError([f"data.{'val_end' if d.train_end else 'test_ratio'}: is {'unset' if d.train_end else 0}, "
                           "so there is no held-out test split to forecast; set it (and retrain: the run's "
                           "validation reached into what would be the test)"], "Invalid forecast configuration")
    finetuned, calibration = finetuned_predictor(cfg)
    store_dir, out_dir, made = folders or run_folders(cfg, out_dir, "forecast")
    with output_folder(out_dir):
        _refuse_replacing(cfg, out_dir)
        data = prepare_data(cfg.data, store_dir)  # the store training made (re-prepared if the files changed)
        windows = held_out_windows(data.splits["test"], cfg.data.window, cfg.forecast.window_stride,
                                   cfg.forecast.max_windows,
                                   history=cfg.forecast.empirical_window + 1)  # + 1: n returns need n + 1 closes
        windows, dropped = _unseen(cfg, data.panel, windows)
        check_memory(cfg, len(windows), 6)  # raw, reported, zero-shot and ensemble paths, and their scoring
        zero_shot = zero_shot_predictor(cfg)
        zs_calibration = None
        if zero_shot is not None and calibration is not None:  # its margins from the same validation windows
            val = held_out_windows(data.splits["val"], cfg.data.window, cfg.forecast.window_stride)
            zs_val = sample_paths(zero_shot, val.context, *val.stamps(), cfg.data.predict, cfg.forecast,
                                  cfg.forecast.batch_size)[..., CLOSE]  # (V, S, P)
            zs_calibration = fit_windows(zs_val, val.actual[..., CLOSE], val.context[:, -1, CLOSE], val.names,
                                         cfg.forecast.decoding(), "zero-shot calibration", "both on raw bands")[0]
        metrics, paths, raw = evaluate_held_out(cfg, finetuned, windows, zero_shot, _season(cfg, data.panel),
                                                calibration, zs_calibration)
        metrics["series_without_test_windows"] = sorted(set(data.panel.names) - set(windows.names))
        metrics["windows_dropped_seen_in_training"] = dropped
        files = {"forecast.csv": forecast_table(windows.names, windows.y_timestamps, paths, windows.actual, raw),
                 "metrics.json": metrics, "forecast.json": provenance(cfg, "forecast", finetuned, made)}
        write_outputs(cfg, out_dir, files, "forecast_vs_actual.png", windows.names, windows.x_timestamps,
                      windows.context, windows.y_timestamps, paths, windows.actual)
    return metrics


def _refuse_replacing(cfg: CsvFinetuneConfig, out_dir: Path) -> None:
    """A held-out forecast folder made with other forecast.* settings is never replaced silently."""
    made = out_dir / "forecast.json"
    was = ((read_json_object(made) if made.is_file() else {}).get("settings") or {}).get("forecast")
    now = config_to_dict(cfg)["forecast"]
    changed = [f"forecast.{k}: {was[k]!r} -> {v!r}" for k, v in now.items() if was is not None and was.get(k) != v]
    if changed:
        raise RefusedError(f"{out_dir} holds a forecast made with other settings ({'; '.join(changed)}); move it "
                           "elsewhere to keep it, or remove it to replace it")


def _unseen(cfg: CsvFinetuneConfig, panel, windows: HeldOutWindows) -> tuple[HeldOutWindows, int]:
    """The windows whose targets lie after all the run trained and validated on (its run_info.json), and how many
    were dropped: a split that moved into the run's own data is never scored as held-out."""
    info = cfg.predictor_dir / "run_info.json"
    bounds = held_out_from(panel, read_json_object(info)) if info.is_file() else {}
    first = np.array([ts[0].value for ts in windows.y_timestamps], dtype=np.int64)  # (N,) first target time
    clean = first >= np.array([bounds.get(n, np.iinfo(np.int64).min) for n in windows.names], dtype=np.int64)
    if not clean.all():
        if not clean.any():
            raise ConfigError([f"data: every one of the {len(windows)} held-out windows overlaps what the run in "
                               f"{cfg.predictor_dir} trained or validated on; forecast with the split it was trained "
                               "with (data.train_ratio / val_ratio / test_ratio, data.train_end / val_end)"],
                              "Invalid forecast configuration")
        log.warning("scoring %d of %d held-out windows: %d overlap what the run trained or validated on (metrics.json: "
                    "windows_dropped_seen_in_training)", clean.sum(), len(windows), (~clean).sum())
    return windows.subset(np.flatnonzero(clean)), int((~clean).sum())


def run_future(cfg: CsvFinetuneConfig, out_dir: Path | None = None, folders: tuple | None = None) -> pd.DataFrame:
    """Forecast the `data.predict` candles after each series' last row; write forecast.csv, forecast.json and
    forecast.png."""
    finetuned, calibration = finetuned_predictor(cfg)
    store_dir, out_dir, made = folders or run_folders(cfg, out_dir, "future")
    with output_folder(out_dir):
        return _future(cfg, finetuned, calibration, store_dir, out_dir, made)


def _future(cfg: CsvFinetuneConfig, finetuned: KronosPredictor, calibration: dict | None, store_dir: Path,
            out_dir: Path, made: dict) -> pd.DataFrame:
    data = prepare_data(cfg.data, store_dir, with_splits=False)  # whole series, no split needed
    panel, zone = data.panel, data.store.manifest.get("timezone")  # the input's zone, when its stamps had one
    lookback, predict = cfg.data.lookback, cfg.data.predict
    short = [name for name, n in zip(panel.names, panel.lengths().tolist()) if n < lookback]
    if short:
        raise DataError(f"series shorter than data.lookback={lookback} rows cannot be forecast: {short}; lower "
                        "data.lookback or remove them")
    trading_dates = read_calendar(cfg.forecast.calendar) if cfg.forecast.calendar else None
    ends = np.asarray(panel.offsets[1:], dtype=np.int64)  # (S,) one past each series' last column
    # One window per series: its last `lookback` bars, no known bar after them; the forecast bars' times come next.
    last = held_out_windows(PanelSegments(panel, ends - lookback, ends - lookback, ends), Window(lookback, 0), 1)
    when = lambda s: pd.DatetimeIndex(np.asarray(panel.datetimes[panel.rows(s)]).astype("datetime64[ns]"))
    last.y_timestamps = [TradingCalendar.learn(when(s), trading_dates, f"series {name!r}", cfg.forecast.holidays)
                         .after(when(s)[-1], predict, name=f"series {name!r}") for s, name in enumerate(last.names)]
    names, past_ts, context, future_ts = last.names, last.x_timestamps, last.context, last.y_timestamps
    check_memory(cfg, len(names), 3)
    paths = sample_paths(finetuned, context, *last.stamps(), predict, cfg.forecast,
                         cfg.forecast.batch_size)  # (N, S, P, 6)
    violations = candle_violations(*np.moveaxis(paths[..., :5], -1, 0))  # open .. volume
    sampled, used = paths[..., CLOSE], None  # (N, S, P) raw closes; the margins applied per series
    log.info("invalid sampled candles: %.1f%%%s", 100 * violations["any"],
             " (repaired: forecast.repair_candles)" if cfg.forecast.repair_candles else
             " (kept; forecast.repair_candles: true repairs them)")
    raw = finish_paths(paths, None, context[:, -1, CLOSE], cfg.forecast.repair_candles)  # uncalibrated, as reported
    if calibration is not None:
        split = {k: v for k, v in calibration.items() if k != "adaptive"}  # split: the stored margins, never a
        used = [adaptive.current_calibration(calibration, name) if cfg.forecast.calibration_method == "adaptive"
                else split for name in names]  # state an earlier adaptive run or `kronos track` left beside them
        paths = np.stack([finish_paths(paths[i : i + 1], used[i], context[i : i + 1, -1, CLOSE],
                                       cfg.forecast.repair_candles)[0] for i in range(len(names))])
    else:
        paths, raw = raw, None  # no calibration: the raw bands are the reported ones
    table = forecast_table(names, future_ts, paths, raw=raw).drop(columns="window")
    if zone:  # aware in, aware out (as predict_df); a wall-clock time DST skips or repeats: the later one
        table["timestamps"] = table["timestamps"].dt.tz_localize(zone, ambiguous=False, nonexistent="shift_forward")
    made = provenance(cfg, "future", finetuned, made)
    write_outputs(cfg, out_dir, {"forecast.csv": table, "forecast.json": made}, "forecast.png", names, past_ts,
                  context, future_ts, paths)
    append_forecasts(cfg.base_dir, journal_records(made["model"], config_to_dict(cfg.forecast), names,
                                                   [ts[-1] for ts in past_ts], context[:, -1, CLOSE], sampled,
                                                   paths[..., CLOSE], used and [u["margins"] for u in used]))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), CsvFinetuneConfig, load)
    parser.add_argument("--future", action="store_true",
                        help="forecast the data.predict candles after each series' last row instead of scoring")
    args = parse_config_args(parser, argv)
    setup_logging()
    cfg = load(args.config, args.set)
    with GracefulStop():  # SIGTERM while sampling: exit 75 before the next batch, nothing half-written
        folders = run_folders(cfg, None, "future" if args.future else "forecast")
        made = (run_future if args.future else run_forecast)(cfg, folders=folders)  # the table, or the metrics
    if args.future:
        print(f"future forecast: {made['series'].nunique()} series x {cfg.data.predict} candles, from "
              f"{made['timestamps'].min()} to {made['timestamps'].max()}")
        print(f"written: {folders[1]}/{{forecast.csv, forecast.json, forecast.png}}")
        return 0
    print(format_report(made))
    print(f"written: {folders[1]}/{{metrics.json, forecast.csv, forecast.json, forecast_vs_actual.png}}")
    return 0


if __name__ == "__main__":
    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
