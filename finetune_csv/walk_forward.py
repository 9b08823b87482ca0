"""Does finetuning pay on your market? A purged, expanding-window walk-forward with a three-word verdict.

`make_folds` cuts K test blocks on one calendar, fold k finetunes the starting models on what precedes its block
(`run_finetune`), `score_fold` scores every non-overlapping test window of every candidate as `kronos forecast` does,
and the verdict (finetune/evaluation/statistics.py) reads the paired finetuned - zero_shot CRPS. Method, outputs and
what the interval means: README "Does finetuning pay?". fold.json is written last and atomically: a re-run skips
folds finished with the same settings."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from filelock import FileLock

import finetune_csv.config as csv_config
from finetune.evaluation.forecast_scores import ScoreSettings, empirical_samples, persistence_samples, window_scores
from finetune.evaluation.held_out import held_out_windows, sample_paths
from finetune.evaluation.report import write_report
from finetune.evaluation.statistics import paired_test, session_test
from finetune.utils import tune
from finetune.utils.cli_args import add_config_args, parse_config_args
from finetune.utils.config_utils import config_to_dict
from finetune.utils.errors import setup_logging
from finetune.utils.fingerprint import digest, forecast_settings, model_fingerprint, training_settings
from finetune.utils.plots import pyplot, save_figure, stamp_text
from finetune.utils.safety import GracefulStop, RunLock
from finetune.utils.windows import PanelSegments
from finetune_csv.config import CsvFinetuneConfig, best_dir
from finetune_csv.forecast import CLOSE, adaptive_held_out, band_quality, band_stats, ensemble_paths, realised_vol
from finetune_csv.prepare import prepare_data
from finetune_csv.splits import date_bounds
from finetune_csv.train_sequential import run_finetune
from model import KronosPredictor
from model.calibration import apply_calibration, decoding_changes, fit_windows
from model.config import Window
from model.errors import ConfigError, DataError, RefusedError
from model.fileio import atomic_write, read_json_object, sha256_file, write_json
from model.predictor import CALIBRATION_FAILED, load_pretrained_pair, load_trained_pair, read_predictor_info

log = logging.getLogger("finetune_csv.walk_forward")
SCORES = ("crps", "mae", "cov50", "cov80", "direction")  # windows.csv score columns (returns vs the last close)


@dataclass(frozen=True)
class Fold:
    """One fold as panel index ranges (arrays (S,) per series, see finetune.utils.windows.PanelSegments)."""

    index: int
    train: PanelSegments
    val: PanelSegments
    test: PanelSegments


def make_folds(panel, window: Window, folds: int, test_bars: int, purge: int, embargo: int,
               val_ratio: float, end: int | None = None) -> list[Fold]:
    """The K folds of `panel` (a SeriesPanel with datetimes) on one calendar, oldest first, using its first `end`
    calendar bars (None: all; tune's inner folds end before the judged blocks); DataError when a fold is left
    without a series."""
    lookback, predict = window.lookback, window.predict
    offsets = np.asarray(panel.offsets, dtype=np.int64)
    first, lengths = offsets[:-1], np.diff(offsets)
    when = np.asarray(panel.datetimes)  # (N,) int64 ns
    calendar = np.unique(when)[:end]  # (C,) every series' bar times: the test blocks are ranges of these
    rows = lambda t, side: np.array([np.searchsorted(when[o:o + n], t, side) for o, n in zip(first, lengths)])
    out, scored = [], np.zeros(len(lengths), dtype=bool)  # (S,) series in at least one fold
    for k in range(folds):
        c1 = len(calendar) - (folds - 1 - k) * (test_bars + embargo)  # one past the block's last calendar bar
        c0 = max(c1 - test_bars, 0)
        t0, t1 = rows(calendar[c0], "left"), rows(calendar[max(c1 - 1, 0)], "right")  # (S,) local test rows
        end = np.maximum(t0 - purge, 0)  # (S,) one past the last validation target: `purge` own bars before t0
        # Validation as `kronos finetune` cuts it (splits.date_bounds): from the date that leaves val_ratio of all
        # the series' candles before `end` after it, the same date for every series
        when_val = date_bounds(panel, 1 - val_ratio, val_ratio, False, first + end)[0] if end.any() else 0
        v0 = np.minimum(rows(when_val, "left"), end)  # (S,) first validation target
        stop = v0 - purge  # one past the last training target
        # A series with a training window before the block trains; without a test window in it, it is not scored.
        trains = (stop >= window.size) & (c1 > test_bars)  # (S,)
        on = trains & (t0 >= lookback) & (t1 - t0 >= predict)
        if not on.any() or not (trains & (end - v0 >= predict)).any():  # a test window; a validation window
            raise DataError(f"fold {k} of walk_forward.folds={folds} blocks of walk_forward.test_bars={test_bars} "
                            f"(+ embargo {embargo}, purge {purge}) leaves no series with a training window of "
                            f"data.lookback + data.predict = {window.size} rows, a validation block and a "
                            f"test window (the longest series has {int(lengths.max())} rows); lower "
                            "walk_forward.folds / test_bars / data.lookback")
        if not on.all():
            log.info("fold %d: %s not scored (no training window before %s or no test window in it; trained on: "
                     "%s)", k, ", ".join(panel.names[s] for s in np.flatnonzero(~on)),
                     stamp_text(int(calendar[c0])), ", ".join(panel.names[s] for s in np.flatnonzero(trains & ~on))
                     or "none of them")
        scored |= on
        cut = first + np.concatenate([np.where(trains, np.stack([stop, v0 - lookback, v0, end]), 0),
                                      np.where(on, np.stack([t0 - lookback, t0, t1]), 0)])  # (7, S)
        out.append(Fold(k, PanelSegments(panel, first, first, cut[0]), PanelSegments(panel, *cut[1:4]),
                        PanelSegments(panel, *cut[4:])))
    if not scored.all():  # the blocks follow the latest series: a verdict on fewer series than the user gave
        log.warning("walk-forward: %s are scored in no fold, only trained on (the test blocks are the last %d x %d "
                    "bars of the calendar, after their data ends): the verdict covers %d of %d series; cut every "
                    "series to a common end date to compare them all",
                    ", ".join(panel.names[s] for s in np.flatnonzero(~scored)[:10]),
                    folds, test_bars, int(scored.sum()), len(scored))
    return out


def fold_dates(fold: Fold) -> dict:
    """The fold's span over the series in it: last training target, validation and test blocks (first / last row)."""
    on = fold.test.stop > fold.test.first_target  # (S,) series in this fold
    when = lambda col, how: stamp_text(int(how(np.asarray(fold.train.panel.datetimes)[col[on]])))
    return {"train_end": when(fold.train.stop - 1, np.max), "val_start": when(fold.val.first_target, np.min),
            "val_end": when(fold.val.stop - 1, np.max), "test_start": when(fold.test.first_target, np.min),
            "test_end": when(fold.test.stop - 1, np.max)}


def score_fold(cfg: CsvFinetuneConfig, fold_cfg: CsvFinetuneConfig, fold: Fold, zero_shot: Path | None = None
               ) -> pd.DataFrame:
    """Every non-overlapping test window of the fold scored with each candidate: one row per (window, candidate).
    `zero_shot`: where the zero-shot's sampled closes (W, S, H) are kept (tune: the same for every trial of these
    data and forecast settings on this fold; sampled once, sealed by sha256)."""
    d, f, m, candidates = cfg.data, cfg.forecast, cfg.model, cfg.walk_forward.candidates
    # The empirical baseline's trailing closes (the last context bar included): n returns need n + 1 closes.
    history = f.empirical_window + 1 if "empirical" in candidates else 0
    windows = held_out_windows(fold.test, d.window, history=history)
    last = windows.context[:, -1, CLOSE]  # (W,)
    obs = windows.actual[..., CLOSE] / last[:, None] - 1.0  # (W, H)
    folder = best_dir(fold_cfg.predictor_dir)
    # Each model loaded once per fold, when first sampled (the zero-shot not at all while tune keeps its paths)
    pairs = {"finetuned": lambda: load_trained_pair(folder)[:2],
             "zero_shot": lambda: load_pretrained_pair(m.pretrained_predictor, m.pretrained_tokenizer)}
    predictor = functools.cache(lambda name: KronosPredictor.from_models(*pairs[name](), window=d.window))
    sample = lambda name, w=windows: sample_paths(predictor(name), w.context, *w.stamps(), d.predict, f,
                                                  f.batch_size)[..., CLOSE]  # (W, S, H)
    zs = lambda w, kept: sample("zero_shot", w) if kept is None else _kept(kept, lambda: sample("zero_shot", w))
    paths = {"zero_shot": zs(windows, zero_shot), "finetuned": sample("finetuned"),
             "persistence": persistence_samples(last, d.predict)}
    if "empirical" in candidates:
        paths["empirical"] = empirical_samples(windows.history, d.predict, windows.history.shape[1])
    info = read_predictor_info(folder)
    calibration, zs_cal = info.get("calibration") if f.calibrate else None, None
    changed = decoding_changes(calibration, f.decoding()) if calibration else ["none fitted yet"]
    val = held_out_windows(fold.val, d.window, f.window_stride)
    fit = lambda raw, what: fit_windows(raw, val.actual[..., CLOSE], val.context[:, -1, CLOSE], val.names,
                                        f.decoding(), f"fold {fold.index}'s {what}", "its raw bands are scored")[0]
    if f.calibrate and changed and CALIBRATION_FAILED not in info:  # tune's units train without one: fitted here once
        log.info("fold %d: fitting the calibration on its validation windows under this sampling (%s)", fold.index,
                 ", ".join(changed))  # sampling only, no training
        calibration = fit(sample("finetuned", val), "calibration")
    if calibration is not None:  # like with like: zero-shot's margins too, from the same validation windows
        zs_cal = fit(zs(val, zero_shot and zero_shot.with_name(zero_shot.stem + "_val.npy")), "zero-shot calibration")
    for name, cal, raw in (("calibrated", calibration, "finetuned"), ("zero_shot_calibrated", zs_cal, "zero_shot")):
        if cal is not None and f.calibration_method == "adaptive":  # replayed in publication order, as forecast
            per = adaptive_held_out(cal, paths[raw], windows, f.per_series)["per_window"]
            paths[name] = np.concatenate([apply_calibration(c, paths[raw][w:w + 1], last[w:w + 1])
                                          for w, c in enumerate(per)])
        if cal is not None and (name == "calibrated" or f.calibration_method != "adaptive"):  # split bands, as
            paths["split" if name in paths else name] = apply_calibration(cal, paths[raw], last)  # forecast ships them
    if "ensemble" in candidates:
        paths["ensemble"] = ensemble_paths(paths["finetuned"], paths["zero_shot"], f.ensemble_weight)
    rows, vol = [], realised_vol(windows.actual[..., CLOSE], last)  # (W,)
    for name in [c for c in [*candidates, "calibrated", "split", "zero_shot_calibrated"] if c in paths]:
        sc = window_scores(paths[name] / last[:, None, None] - 1.0, obs, ScoreSettings())
        width = band_stats(paths[name], windows.actual[..., CLOSE], last)[1]  # (W,) for calibration_fields
        rows.append(pd.DataFrame({
            "fold": fold.index, "series": windows.names, "window_start": [ts[0] for ts in windows.y_timestamps],
            "candidate": name, "crps": sc["crps"].mean(axis=1), "mae": sc["abs_err"].mean(axis=1),
            "cov50": sc["coverage_50"].mean(axis=1), "cov80": sc["coverage_80"].mean(axis=1),
            "direction": sc["direction_hit"], "width80": width, "vol": vol}))
    return pd.concat(rows, ignore_index=True)


def calibration_fields(frame: pd.DataFrame, method: str) -> dict | None:
    """metrics.json's band fields (`finetune_csv.forecast.band_quality`) of windows.csv rows: raw = the "finetuned"
    candidate, calibrated = "calibrated" (split or adaptive: `method`), and "split" beside adaptive; None without
    calibrated rows."""
    if "width80" not in frame.columns or not (frame.candidate == "calibrated").any():
        return None
    wide = frame[frame.candidate == "finetuned"].merge(frame[frame.candidate == "calibrated"], suffixes=("_raw", ""),
                                                       on=["fold", "series", "window_start"])
    if wide.empty:
        return None
    split = frame[frame.candidate == "split"].rename(columns={"cov80": "cov80_split", "width80": "width80_split"})
    wide = wide.merge(split[["fold", "series", "window_start", "cov80_split", "width80_split"]], "left")
    bands = ("raw", "calibrated", "split") if len(split) else ("raw", "calibrated")
    cov = {k: wide[f"cov80_{k}" if k != "calibrated" else "cov80"].to_numpy() for k in bands}
    width = {k: wide[f"width80_{k}" if k != "calibrated" else "width80"].to_numpy() for k in bands}
    return {"method": "adaptive" if method == "adaptive" else "conformal", "cov80_raw": float(cov["raw"].mean()),
            "cov80_calibrated": float(cov["calibrated"].mean()),
            **band_quality(cov, width, wide["vol"].to_numpy(), wide["window_start"])}


def paired_from_windows(frame: pd.DataFrame) -> dict:
    """paired.finetuned_vs_zero_shot from windows.csv rows (the verdict's windows): {"crps": ..., "mae": ...}, each
    `session_test` (intraday windows: one date per trading session) on the finetuned - zero_shot differences
    (windows are non-overlapping: no known lag) with each fold's own mean and interval (or the reason there is none)
    and the share of folds finetuning won."""
    keys = ["fold", "series", "window_start"]
    wide = frame[frame.candidate == "finetuned"].merge(frame[frame.candidate == "zero_shot"], on=keys,
                                                       suffixes=("_f", "_z"))
    out = {}
    for s in ("crps", "mae"):
        wide["d"] = wide[f"{s}_f"] - wide[f"{s}_z"]
        test = session_test(wide["d"], wide["window_start"], what=f"finetuned - zero_shot {s.upper()}")
        test["per_fold"] = [{"fold": int(k), **{x: t[x] for x in ("mean", "windows", "ci_low", "ci_high", "reason")}}
                            for k, g in wide.groupby("fold") for t in [session_test(g["d"], g["window_start"],
                                                                                    what=f"fold {k} {s.upper()}")]]
        test["share_folds_won"] = float(np.mean([r["mean"] < 0 for r in test["per_fold"]]))
        out[s] = test
    return out


def best_candidate(frame: pd.DataFrame) -> dict:
    """Every candidate ranked by mean CRPS over the windows all of them scored; the best with the `session_test`
    interval of its CRPS minus the runner-up's (< 0 = the best is ahead)."""
    wide = frame.pivot_table(index=["fold", "series", "window_start"], columns="candidate", values="crps").dropna()
    ranking = wide.mean().sort_values()
    best, rival = ranking.index[0], ranking.index[1]
    test = session_test(wide[best] - wide[rival], wide.index.get_level_values("window_start"),
                        what=f"CRPS {best} - {rival}")
    return {"candidate": best, "ranking": {k: float(v) for k, v in ranking.items()}, "runner_up": rival,
            "test": test, "line": f"best by CRPS: {best} (" + " < ".join(f"{k} {v:.5f}" for k, v in ranking.items())
            + f"); against {rival}: {test['reason']}"}


def _settings(cfg: CsvFinetuneConfig) -> dict:
    """The settings a fold's, a unit's or a study's results depend on (finetune/utils/fingerprint.py): training and
    forecast settings, the walk-forward's, the starting models' content; never paths, run flags or the study."""
    return {**training_settings(cfg), "forecast": forecast_settings(cfg),
            "walk_forward": config_to_dict(cfg.walk_forward),
            "start": {k: model_fingerprint(getattr(cfg.model, k)) for k in ("pretrained_tokenizer",
                                                                            "pretrained_predictor")}}


def _fingerprint(cfg: CsvFinetuneConfig, fold: Fold, manifest: dict) -> dict[str, str | None]:
    """What a fold's results depend on (finetune/utils/fingerprint.py), part by part so a change is named: the
    training, forecast and walk-forward settings, its index ranges, the data files' and the starting models' content
    (never their paths)."""
    ranges = [getattr(getattr(fold, s), a).tolist() for s in ("train", "val", "test")
              for a in ("start", "first_target", "stop")]
    parts = {"settings": [training_settings(cfg), forecast_settings(cfg), config_to_dict(cfg.walk_forward)],
             "ranges": ranges, "data": [f.get("sha256") for f in manifest.get("sources", [])]}
    models = {f"model.{k}": model_fingerprint(getattr(cfg.model, k)) for k in ("pretrained_tokenizer",
                                                                               "pretrained_predictor")}
    return {**{k: digest(v)[:16] for k, v in parts.items()}, **models}


def _reuse_fold(folder: Path, fingerprint: dict, report_only: bool, overwrite: bool) -> dict | None:
    """The fold in `folder`: its fold.json record when it is current (made with `fingerprint`, and its windows.csv
    the bytes it recorded), else None: score it again (after deleting the folder under `overwrite`). Refused
    (RefusedError): a fold of other settings or data without `overwrite`, and under `report_only` any fold that is
    not current."""
    done, rows = folder / "fold.json", folder / "windows.csv"
    info = read_json_object(done) if done.is_file() else None
    old = (info or {}).get("fingerprint")  # a string in a fold.json of an older version
    other = "" if info is None or old == fingerprint else ", ".join(
        k for k in fingerprint if isinstance(old, dict) and old.get(k) != fingerprint[k]) or "settings or data"
    why = "it holds no finished fold" if info is None else f"its fold was made with other {other}" if other \
        else None if rows.is_file() and sha256_file(rows) == info.get("windows_sha256") else \
        "its windows.csv is not the one fold.json recorded (damaged, edited, or written before it was hashed)"
    if why is None and (report_only or not overwrite):
        return info
    if report_only:
        raise RefusedError(f"--report-only: {folder} holds no fold finished with these settings and data ({why}); "
                           "run without --report-only (with --overwrite to redo folds of other settings)")
    if other and not overwrite:
        raise RefusedError(f"{folder} holds a finished fold made with other {other}; pass "
                           "--overwrite to redo every fold, or choose another paths.base_dir")
    if overwrite and folder.exists():
        log.warning("--overwrite: replacing %s", folder)
        shutil.rmtree(folder)
    elif info is not None:
        log.warning("%s: %s; scoring the fold again", folder, why)
    return None


def run_walk_forward(cfg: CsvFinetuneConfig, overwrite: bool = False, report_only: bool = False) -> dict:
    """Train and score every fold (skipping finished ones), then write report.json, windows.csv and the plot;
    `report_only`: only the last step, from the finished folds' windows.csv (RefusedError naming one that is not)."""
    _check(cfg)
    w, d = cfg.walk_forward, cfg.data
    out = cfg.base_dir / "walk_forward"
    # One stop request for the whole walk-forward: SIGTERM while a fold trains, scores or calibrates ends at the next
    # safe point with exit 75, and the re-run skips the finished folds.
    with GracefulStop(), RunLock(out, key="paths.base_dir"):
        data = prepare_data(d, cfg.store_dir, with_splits=False)
        test_bars, purge = _blocks(cfg, data.panel)
        folds = make_folds(data.panel, d.window, w.folds, test_bars, purge, w.embargo, d.val_ratio)
        started, trained, rows, meta = time.monotonic(), 0, [], []
        for fold in folds:
            folder = out / f"fold_{fold.index}"
            fp = _fingerprint(cfg, fold, data.store.manifest)
            info = _reuse_fold(folder, fp, report_only, overwrite)  # current, or refused, or None
            if info is not None:
                log.info("fold %d of 0..%d: finished before (%s), skipped", fold.index, len(folds) - 1, folder)
            else:
                info = _run_fold(cfg, fold, folder, fp)
                trained += 1
                left = (time.monotonic() - started) / trained * (len(folds) - 1 - fold.index)
                log.info("fold %d of 0..%d: %s; scored %d test windows x %d candidates, CRPS finetuned %.5f vs "
                         "zero_shot %.5f; %.0f s so far, about %.0f s left", fold.index, len(folds) - 1,
                         info["trained"], info["windows"]["test"], len(info["scores"]),
                         info["scores"]["finetuned"]["crps"], info["scores"]["zero_shot"]["crps"],
                         time.monotonic() - started, left)
            rows.append(pd.read_csv(folder / "windows.csv", parse_dates=["window_start"]))
            meta.append(info)
        return _report(cfg, out, pd.concat(rows, ignore_index=True), meta, test_bars, purge)


def _blocks(cfg: CsvFinetuneConfig, panel) -> tuple[int, int]:
    """(test_bars, purge): the settings, or their defaults: 10% of the shortest series in whole windows; predict."""
    w, d = cfg.walk_forward, cfg.data
    test_bars = w.test_bars or max(d.predict, int(0.1 * int(panel.lengths().min())) // d.predict * d.predict)
    return test_bars, w.purge if w.purge is not None else d.predict


def _check(cfg: CsvFinetuneConfig) -> None:
    m = cfg.model
    if m.pretrained_predictor is None or m.pretrained_tokenizer is None:
        raise ConfigError(["model.pretrained_predictor / model.pretrained_tokenizer: walk-forward compares the "
                           "finetuned model with its starting model; set both (a folder or Hub id)"],
                          "Invalid walk-forward configuration")
    if cfg.predictor_training.epochs == 0 or (cfg.predictor_training.epochs is None and cfg.training.epochs == 0):
        raise ConfigError(["predictor_training.epochs: is 0, so no fold would finetune the predictor; set it >= 1"],
                          "Invalid walk-forward configuration")


def _train_fold(cfg: CsvFinetuneConfig, fold: Fold, folder: Path) -> tuple[CsvFinetuneConfig, tuple]:
    """(the fold's run config, `run_finetune`'s result): its own stage folders under `folder`, the run's data store;
    --skip-existing: a finished stage is reused while current for this fold's data and settings, else retrained."""
    fold_cfg = dataclasses.replace(cfg, paths=dataclasses.replace(cfg.paths, base_dir=str(folder)),
                                   data=dataclasses.replace(cfg.data, store_dir=str(cfg.store_dir)),
                                   training=dataclasses.replace(cfg.training, overwrite=False))
    return fold_cfg, run_finetune(fold_cfg, skip_existing=True, splits={"train": fold.train, "val": fold.val})


def _run_fold(cfg: CsvFinetuneConfig, fold: Fold, folder: Path, fp: dict) -> dict:
    """Finetune (resuming an interrupted stage) and score one fold; write its windows.csv, then fold.json."""
    t0 = time.monotonic()
    fold_cfg, (results, plan, info) = _train_fold(cfg, fold, folder)
    reused = {r.stage: "reused" if r.skipped else "trained" for r in results}
    t1 = time.monotonic()
    frame = score_fold(cfg, fold_cfg, fold)
    atomic_write(folder / "windows.csv", lambda p: frame.to_csv(p, index=False))
    dates = fold_dates(fold)
    record = {
        "fold": fold.index, **dates, "fingerprint": fp, "windows_sha256": sha256_file(folder / "windows.csv"),
        "windows": {"train": info["splits"]["train"]["windows"], "val": info["splits"]["val"]["windows"],
                    "test": int((frame.candidate == "finetuned").sum())},
        "trained": ", ".join(f"{s} {reused.get(s) or f'skipped ({why})'}" for s, why in plan.items()),
        "scores": {c: {s: float(g[s].mean()) for s in SCORES} for c, g in frame.groupby("candidate", sort=False)},
        "calibration": calibration_fields(frame, cfg.forecast.calibration_method),
        "seconds": {"train": round(t1 - t0, 1), "score": round(time.monotonic() - t1, 1)}}
    write_json(folder / "fold.json", record)
    return record


def _report(cfg: CsvFinetuneConfig, out: Path, frame: pd.DataFrame, meta: list[dict], test_bars: int,
            purge: int) -> dict:
    w, f = cfg.walk_forward, cfg.forecast
    cutoff = pd.Timestamp(str(cfg.model.pretraining_cutoff)) if cfg.model.pretraining_cutoff else None
    excluded = {r["fold"] for r in meta if cutoff is not None and pd.Timestamp(r["test_start"]) < cutoff}
    frame["in_verdict"] = ~frame["fold"].isin(excluded)
    used = frame[frame.in_verdict]
    folds = [{**{k: v for k, v in r.items() if k not in ("fingerprint", "windows_sha256")}, "purge": purge,
              "embargo": w.embargo, "before_pretraining_cutoff": r["fold"] in excluded} for r in meta]
    report = {"settings": {"folds": w.folds, "test_bars": test_bars, "purge": purge, "embargo": w.embargo,
                           "candidates": list(w.candidates), "lookback": cfg.data.lookback, "predict": cfg.data.predict,
                           "samples": f.sample_count, "pretraining_cutoff": cfg.model.pretraining_cutoff},
              "folds": folds, "excluded_folds": sorted(excluded),
              "scores": {c: {s: float(g[s].mean()) for s in SCORES} for c, g in used.groupby("candidate", sort=False)}}
    if used.empty:
        report.update(paired=None, verdict="no_evidence",
                      verdict_reason="every test block starts before model.pretraining_cutoff")
    else:
        paired = paired_from_windows(used)
        report["paired"] = {"finetuned_vs_zero_shot": paired}
        report["verdict"], report["verdict_reason"] = paired["crps"]["verdict"], paired["crps"]["reason"]
        report["best"] = best_candidate(used)
    report["calibration"] = calibration_fields(used, f.calibration_method)
    report["seconds"] = {k: round(sum(r["seconds"][k] for r in meta), 1) for k in ("train", "score")}
    out_frame = frame.assign(window_start=frame["window_start"].astype(str))
    atomic_write(out / "windows.csv", lambda p: out_frame.to_csv(p, index=False))
    plot_walk_forward(report, used, out / "walk_forward.png")
    write_json(out / "report.json", report)
    write_report(out)
    return report


def plot_walk_forward(report: dict, frame: pd.DataFrame, png: Path) -> Path:
    """Top: finetuned - zero_shot CRPS per fold and the overall interval (where the verdict prints one); bottom:
    cumulative CRPS by candidate over time."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), dpi=100)
    paired = (report.get("paired") or {}).get("finetuned_vs_zero_shot")
    if paired:
        per = paired["crps"]["per_fold"]
        x = np.arange(len(per))
        mean = np.array([r["mean"] for r in per])
        top.plot(x, mean, "o", label="fold mean")  # no per-fold interval: the text prints none either
        c = paired["crps"]
        if c["ci_low"] is not None:  # the interval the verdict line prints, only where the rule claims one
            top.axhspan(c["ci_low"], c["ci_high"], color="tab:orange", alpha=0.2, label="all folds, 95% interval")
        top.set_xticks(x, [f"fold {r['fold']}" for r in per])
        top.set_title(f"finetuned - zero_shot CRPS per window (< 0 = finetuning helped): {report['verdict']}",
                      fontsize=9)
        top.legend(fontsize=7)
    top.axhline(0, color="0.5", linewidth=0.8)
    for name, g in frame.groupby("candidate", sort=False):
        series = g.groupby("window_start")["crps"].mean().sort_index().cumsum()
        bottom.plot(series.index, series.to_numpy(), label=name)
    bottom.set_title("cumulative CRPS (mean over series per date) by candidate", fontsize=9)
    bottom.legend(fontsize=7)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return save_figure(fig, png)


def format_table(report: dict) -> str:
    """The console summary: scores by candidate, per-fold paired differences, the paired test and the verdict."""
    s = report["settings"]
    n = report["paired"]["finetuned_vs_zero_shot"]["crps"]["windows"] if report.get("paired") else 0
    lines = [f"walk-forward: {s['folds']} folds, test blocks of {s['test_bars']} calendar bars (purge {s['purge']},"
             f" embargo {s['embargo']}), {n} paired test windows of {s['predict']} bars; returns vs the last close",
             f"{'':21}{'CRPS':>9}{'MAE':>9}{'cov50':>7}{'cov80':>7}{'dir':>7}"]
    for name, sc in report["scores"].items():
        lines.append(f"{name:21}{sc['crps']:9.5f}{sc['mae']:9.5f}{sc['cov50']:7.2f}{sc['cov80']:7.2f}"
                     f"{sc['direction']:7.3f}")
    if report.get("paired"):
        p = report["paired"]["finetuned_vs_zero_shot"]
        for r in p["crps"]["per_fold"]:
            meta = report["folds"][r["fold"]]
            lines.append(f"fold {r['fold']} {meta['test_start']} .. {meta['test_end']}: CRPS diff {r['mean']:+.5f} "
                         f"({r['windows']} windows)")
        for key in ("crps", "mae"):  # the one interval rule: no interval printed below MIN_BLOCKS blocks
            lines.append(f"{p[key]['reason']}; finetuning won {p[key]['share_folds_won']:.0%} of folds")
    if report["excluded_folds"]:
        lines.append(f"folds {report['excluded_folds']} start before model.pretraining_cutoff: not in the verdict")
    lines.append(f"verdict: {report['verdict']} ({report['verdict_reason']})")
    if report.get("best"):
        lines.append(report["best"]["line"])
    return "\n".join(lines)


def run_tune(cfg: CsvFinetuneConfig, build, args: argparse.Namespace) -> dict:
    """`kronos tune`: the study of finetune/utils/tune.py on inner folds before the walk-forward's blocks, then the
    selected and the given settings refit per walk-forward fold and judged there; writes tune/report.json.
    `build(values)`: the config with {dotted key: value} applied, validated; `args`: the flags of `tune_main`."""
    tc, d = cfg.tune, cfg.data
    tune.check_space(tc, build)
    _check(cfg)
    out = cfg.base_dir / "tune"
    with GracefulStop():
        data = prepare_data(d, cfg.store_dir, with_splits=False)
        files = [f.get("sha256") for f in data.store.manifest.get("sources", [])]

        def scored(c: CsvFinetuneConfig, inner: bool, k: int | None = None) -> pd.DataFrame:
            """Every fold's windows of the trial `c` (nested: the inner folds before judged fold k, or fold k alone):
            candidates, plus `trial` (its model as it forecasts)."""
            folds = tune_folds(c, data.panel, inner, k or 0)
            frames = [_unit(cfg, c, f, out, files) for f in (folds if inner or k is None else folds[k:k + 1])]
            frame = pd.concat(frames, ignore_index=True)
            own = "calibrated" if c.forecast.calibrate and (frame.candidate == "calibrated").any() else "finetuned"
            zs = "zero_shot_calibrated" if own == "calibrated" and (frame.candidate == "zero_shot_calibrated").any() \
                else "zero_shot"  # like with like: the zero-shot model with the trial's bands
            return pd.concat([frame, frame[frame.candidate == own].assign(candidate="trial"),
                              frame[frame.candidate == zs].assign(candidate="zero_shot_trial")], ignore_index=True)

        def objective(params: dict, number: int, k: int | None = None) -> dict:
            wide = scored(build(params), True, k).pivot_table(index=["fold", "series", "window_start"],
                                                              columns="candidate", values="crps")
            diff = (wide["trial"] - wide["zero_shot_trial"]).groupby(
                wide.index.get_level_values("window_start").normalize()).mean()  # one value per session
            return {str(d.date()): v for d, v in diff.items()}

        holdout = [fold_dates(f) for f in tune_folds(cfg, data.panel, False)]
        ks = list(range(len(holdout))) if tc.mode == "nested" else [None]  # one study per judged fold, or one
        found = [tune.run(out if k is None else out / f"fold_{k}", tc, {
            "settings": _settings(cfg), "space": tc.space, "inner_folds": tc.inner_folds, "seed": tc.seed,
            "data": files, "inner": [fold_dates(f) for f in tune_folds(cfg, data.panel, True, k or 0)]},
            holdout if k is None else holdout[k:k + 1], config_to_dict(cfg), lambda p, n, k=k: objective(p, n, k),
            args, "tune", paired_test) for k in ks]
        if found[0] is None:
            return {}
        frames = {"tuned": pd.concat([scored(build(f["selected"]["settings"]), False, k) for k, f in zip(ks, found)]),
                  "default": scored(cfg, False)}
    tuned = frames["tuned"]
    frame = pd.concat([tuned[~tuned.candidate.isin(["finetuned", "calibrated", "split", "trial", "zero_shot_trial",
                                                    "zero_shot_calibrated"])],
                       *(f[f.candidate == "trial"].assign(candidate=k) for k, f in frames.items())])
    keys = ["fold", "series", "window_start"]
    wide = frame.pivot_table(index=keys, columns="candidate", values="crps")
    wide = wide.assign(like=tuned[tuned.candidate == "zero_shot_trial"].groupby(keys)["crps"].mean()  # same bands
                       .reindex(wide.index)).dropna()
    when = wide.index.get_level_values("window_start")
    outer = {f"tuned_vs_{o}": session_test(wide["tuned"] - wide[x], when, what=f"CRPS tuned - {o}")
             for o, x in (("zero_shot", "like"), ("default", "default"))}
    report = tune.write_report(out, found[0] if ks == [None] else tune.pool(found), outer, best_candidate(frame),
                               holdout=holdout,
                               scores={c: float(v) for c, v in wide.drop(columns="like").mean().items()},
                               calibration=calibration_fields(frames["tuned"], cfg.forecast.calibration_method))
    write_report(out)  # tune/report.html
    return report


def tune_folds(cfg: CsvFinetuneConfig, panel, inner: bool, before: int = 0) -> list[Fold]:
    """The walk-forward's folds, or (`inner`) tune's: tune.inner_folds blocks of the same size ending purge + embargo
    calendar bars before judged block `before` (nested mode; else the first), so no inner bar is within that of its
    targets."""
    w, d = cfg.walk_forward, cfg.data
    test_bars, purge = _blocks(cfg, panel)
    judged = len(np.unique(panel.datetimes)) - (w.folds - before) * test_bars - (w.folds - 1 - before) * w.embargo
    return make_folds(panel, d.window, cfg.tune.inner_folds if inner else w.folds, test_bars, purge, w.embargo,
                      d.val_ratio, judged - purge - w.embargo if inner else None)


def _unit(cfg: CsvFinetuneConfig, c: CsvFinetuneConfig, fold: Fold, out: Path, files: list) -> pd.DataFrame:
    """The windows of trial settings `c` on `fold`, trained once per unit (training settings, fold dates, data; the
    forecast-only keys fixed to the given config's, so they never retrain) and scored once per forecast settings."""
    # No calibration at training: fitted once per forecast settings when scored (under the trial's sampling)
    unit = dataclasses.replace(c, forecast=dataclasses.replace(cfg.forecast, calibrate=False))
    folder = out / "units" / tune.unit_fingerprint(_settings(unit), fold_dates(fold), files)
    rows = folder / f"windows_{digest(config_to_dict(c.forecast))[:12]}.csv"  # one file per forecast settings
    sealed = rows.with_suffix(".sha256")  # its hash, written after it: reused only while the bytes are tune's
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):  # another worker on the same unit: wait, then reuse its result
        if rows.is_file() and not (sealed.is_file() and sealed.read_text() == sha256_file(rows)):
            log.warning("%s is not the file tune wrote (edited, damaged or unsealed): scoring the unit again", rows)
            rows.unlink()
        if not rows.is_file():
            fold_cfg, (results, _, _) = _train_fold(unit, fold, folder)
            ledger = out / "trainings.jsonl"  # every unit, whichever run trained it: tests count units trained twice
            known = ledger.is_file() and f'"unit": "{folder.name}"' in ledger.read_text()
            if any(not r.skipped for r in results) or not known:  # e.g. trained by a run stopped before scoring
                with open(ledger, "a") as fh:
                    fh.write(json.dumps({"unit": folder.name, "fold": fold.index}) + "\n")
            zero = digest([training_settings(c)["data"], _settings(c)["start"], forecast_settings(c),
                           fold_dates(fold), files])[:16]  # its windows, models and sampling: shared by the trials
            frame = score_fold(c, fold_cfg, fold, out / "zero_shot" / f"{zero}.npy")
            atomic_write(rows, lambda p: frame.to_csv(p, index=False))
            atomic_write(sealed, lambda p: Path(p).write_text(sha256_file(rows)))
    return pd.read_csv(rows, parse_dates=["window_start"])


def _kept(path: Path, make) -> np.ndarray:
    """`make()`'s array, kept in `path` (.npy) with its sha256 beside it: reused only while the bytes are those."""
    sealed = path.with_suffix(".sha256")
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not (path.is_file() and sealed.is_file() and sealed.read_text() == sha256_file(path)):
            value = make()
            atomic_write(path, lambda p: Path(p).write_bytes(_npy(value)))
            atomic_write(sealed, lambda p: Path(p).write_text(sha256_file(path)))
        return np.load(path)


def _npy(value: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value)
    return buffer.getvalue()


def tune_main(argv: list[str] | None = None) -> int:
    parser = add_config_args(argparse.ArgumentParser(description="Which finetuning settings pay? (tune: settings)"),
                             csv_config.CsvFinetuneConfig, csv_config.load)
    args = parse_config_args(tune.add_worker_args(parser), argv)
    setup_logging()
    cfg = csv_config.load(args.config, args.set)
    run_tune(cfg, lambda values: csv_config.load(args.config, args.set, values=values), args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), csv_config.CsvFinetuneConfig,
                             csv_config.load)
    parser.add_argument("--overwrite", action="store_true",
                        help="redo every fold, replacing walk_forward/ (default: finished folds are kept and skipped)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite report.json, windows.csv and the plot from the finished folds, training nothing")
    args = parse_config_args(parser, argv)
    setup_logging()
    cfg = csv_config.load(args.config, args.set)
    report = run_walk_forward(cfg, overwrite=args.overwrite, report_only=args.report_only)
    print(format_table(report))
    print(f"written: {cfg.base_dir / 'walk_forward'}/{{report.json, windows.csv, walk_forward.png, fold_*/}}")
    return 0


if __name__ == "__main__":
    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
