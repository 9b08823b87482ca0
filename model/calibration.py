"""Split-conformal calibration of a predictor's sampled bands: fitted on validation windows (`fit_windows`), stored in
kronos_predictor.json (`write_calibration`) and applied to every forecast's sample paths (`apply_calibration`). Why
the margins are in band units: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from model.errors import DataError
from model.fileio import check_seal, read_json_object, seal, write_json

log = logging.getLogger(__name__)
MAX_MARGIN = 5.0  # |calibration margin| in log-return units (x148 in price): beyond it a file is not a calibration
MIN_KEEP = 0.1  # a calibration keeps at least this share of each path's distance from the median: no zero-width band
CALIBRATION_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # central band levels with a margin


def fit_calibration(samples: np.ndarray, outcomes: np.ndarray, last: np.ndarray) -> dict[str, Any]:
    """Split-conformal margins of the sampled bands, per horizon, in log-return space: `samples (W, S, H)` close
    paths of W validation windows, `outcomes (W, H)` realised closes, `last (W,)` last context closes ->
    {"method": "conformal", "space": "band", "levels", "margins": [[H floats] per level], "windows": W,
    "too_few_windows": [levels whose rank exceeds W]}. The construction, its guarantee and why no shrinkage:
    docs/architecture.md, "Formats and designs"."""
    samples, outcomes, last = (np.asarray(a, dtype=np.float64) for a in (samples, outcomes, last))
    if samples.ndim != 3 or outcomes.shape != (samples.shape[0], samples.shape[2]) or last.shape != samples.shape[:1]:
        raise DataError(f"fit_calibration needs samples (W, S, H), outcomes (W, H), last (W,); got "
                        f"{samples.shape}, {outcomes.shape}, {last.shape}")
    for name, a in (("samples", samples), ("outcomes", outcomes), ("last", last)):
        if not (np.isfinite(a).all() and (a > 0).all()):
            raise DataError(f"fit_calibration: {name} must be finite positive prices (log returns)")
    if samples.shape[0] < 1:
        raise DataError("fit_calibration needs at least one window")
    r = np.log(samples / last[:, None, None])  # (W, S, H)
    y = np.log(outcomes / last[:, None])       # (W, H)
    w = len(y)
    margins, short = [], []
    for c in CALIBRATION_LEVELS:
        lo, med, hi = np.quantile(r, [(1 - c) / 2, 0.5, (1 + c) / 2], axis=1)  # (W, H) each
        scores = np.sort(np.maximum((lo - y) / np.maximum(med - lo, 1e-12), (y - hi) / np.maximum(hi - med, 1e-12)),
                         axis=0)  # (W, H)
        rank = math.ceil((w + 1) * c - 1e-9)  # 1e-9: (W + 1) c is an integer in exact arithmetic, e.g. 9 at W 9, 90%
        short += [c] if rank > w else []
        margins.append(np.clip(scores[min(rank, w) - 1], MIN_KEEP - 1, MAX_MARGIN).tolist())
    return {"method": "conformal", "space": "band", "levels": list(CALIBRATION_LEVELS), "margins": margins,
            "windows": w, "too_few_windows": short}


def fit_windows(samples: np.ndarray, outcomes: np.ndarray, last: np.ndarray, names: list[str],
                decoding: dict[str, Any], what: str, advice: str) -> tuple[dict[str, Any] | None, dict[str, int]]:
    """`fit_calibration` on the validation windows whose closes are all finite and positive, the one fit of `kronos
    finetune`, forecast's zero-shot and each walk-forward fold: `samples (W, S, H)` sampled closes (drawn under
    `decoding`, recorded), `outcomes (W, H)`, `last (W,)`, `names (W,)` series. Any other window (in practice: a path
    crossed zero) is left out, counted in "excluded" {series: n} and one WARNING (`what`; `advice` when none is left).
    -> (the calibration or None, excluded)."""
    samples, outcomes, last = (np.asarray(a, dtype=np.float64) for a in (samples, outcomes, last))
    ok = np.all([(np.isfinite(a) & (a > 0)).all(axis=tuple(range(1, a.ndim))) for a in (samples, outcomes, last)],
                0).astype(bool)  # (W,); W = 0 too
    excluded = dict(Counter(n for n, good in zip(names, ok) if not good))
    if excluded:
        log.warning("%s: %d of %d validation windows left out, a sampled or realised close <= 0 (series: %s)%s", what,
                    int((~ok).sum()), len(ok), ", ".join(f"{k} ({v})" for k, v in excluded.items()),
                    "" if ok.any() else f"; none is left: no calibration; {advice}")
    return ({**fit_calibration(samples[ok], outcomes[ok], last[ok]), "decoding": dict(decoding)}
            | ({"excluded": excluded} if excluded else {}) if ok.any() else None), excluded


def apply_calibration(calibration: dict[str, Any], samples: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Calibrated close paths: samples (..., S, H) with last (...) the last context close -> same shape. Each
    path's log return is moved away from (margin > 0) or toward (margin < 0) the per-horizon median of the S paths by
    the margin of its own central level: a path of rank k has quantile level p = (k + 0.5) / S and central level
    c = |2p - 1|; its margin is interpolated between the stored levels (from 0 at c = 0, the last level's beyond it).
    The quantile q of the result therefore approximates the calibrated band edge of level |2q - 1|. A path never
    crosses the median; a horizon where a price is not positive is left as it is."""
    return np.asarray(samples) * np.exp(calibration_shift(calibration, samples, last))


def calibration_shift(calibration: dict[str, Any], close: np.ndarray, last: np.ndarray) -> np.ndarray:
    """The log-return change `apply_calibration` makes: close (..., S, H), last (...) -> (..., S, H) (multiply
    any price of the path by its exp)."""
    levels, margins = calibration_margins(calibration, "calibration")  # (L,), (L, H_cal)
    close = np.asarray(close, dtype=np.float64)
    s, h = close.shape[-2:]
    if h > margins.shape[1]:
        raise DataError(f"the calibration covers {margins.shape[1]} horizons but {h} are forecast; forecast at most "
                        f"{margins.shape[1]} steps or pass calibrated=False")
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.log(close / np.asarray(last, dtype=np.float64)[..., None, None])  # (..., S, H)
    med = np.median(r, axis=-2, keepdims=True)
    rank = np.argsort(np.argsort(r, axis=-2, kind="stable"), axis=-2, kind="stable")
    central = np.abs(2 * (rank + 0.5) / s - 1)  # (..., S, H)
    margin = np.stack([np.interp(central[..., j], np.r_[0.0, levels], np.r_[0.0, margins[:, j]])
                       for j in range(h)], axis=-1)
    side = np.sign(r - med)
    moved = r + (side * margin if calibration["space"] == "log_return" else (r - med) * margin)
    floor = med + MIN_KEEP * (r - med)  # a path never crosses the median, nor comes closer than MIN_KEEP of its way
    moved = np.where(side > 0, np.maximum(moved, floor), np.minimum(moved, floor))
    shift = np.where(side == 0, 0.0, moved - r)
    return np.where(np.isfinite(shift), shift, 0.0)


def calibration_margins(calibration: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A calibration dict checked -> (levels (L,), margins (L, H)); DataError naming `where` otherwise."""
    ok = (isinstance(calibration, dict) and calibration.get("method") == "conformal"
          and calibration.get("space") in ("band", "log_return"))
    try:
        levels = np.asarray(calibration["levels"], dtype=np.float64)
        margins = np.asarray(calibration["margins"], dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        ok = False
    ok = ok and levels.ndim == 1 and margins.ndim == 2 and len(margins) == len(levels) > 0 and margins.shape[1] > 0
    if not (ok and (np.diff(levels) > 0).all() and 0 < levels[0] and levels[-1] < 1):
        raise DataError(f"{where}: not a calibration as fit_calibration writes it ({{'method': 'conformal', 'space': "
                        "'band', 'levels': increasing in (0, 1), 'margins': [[finite per horizon] per level]}})")
    low = MIN_KEEP - 1 if calibration["space"] == "band" else -MAX_MARGIN  # band: >= -0.9 keeps a band's width
    bad = ~((margins >= low) & (margins <= MAX_MARGIN))  # NaN too
    if bad.any():
        raise DataError(f"{where}: calibration margins must be finite and within [{low:g}, {MAX_MARGIN:g}] "
                        f"({calibration['space']} units; below {MIN_KEEP - 1:g} a band would collapse); "
                        f"margins[{np.argwhere(bad)[0][0]}] holds {margins[bad][0]!r}; refit the calibration, or "
                        "forecast with calibrated=False (the CLI: --set forecast.calibrate=false)")
    return levels, margins


def decoding_changes(calibration: dict[str, Any], decoding: dict[str, Any]) -> list[str]:
    """How `decoding` ({T, top_k, top_p, sample_count}) differs from the sampling the margins were fitted under
    (its "decoding" record): ["sample_count 4 -> 6", ...]; [] when it records none (a calibration made by hand).
    The margins hold only for that sampling: a path's quantile level depends on all four."""
    was = calibration.get("decoding")
    return [] if was is None else [f"{k} {was.get(k)!r} -> {v!r}" for k, v in decoding.items() if was.get(k) != v]


def write_calibration(info_path: str | os.PathLike, calibration: dict[str, Any]) -> Path:
    """Add (or replace) "calibration" in the predictor's kronos_predictor.json at `info_path` (created when absent),
    atomically, keeping its other keys, and re-seal its folder (SHA256SUMS); returns its path."""
    calibration_margins(calibration, "calibration")
    path = Path(info_path)
    check_seal(path.parent)  # re-sealed below: only a folder still as written may be
    info = read_json_object(path) if path.is_file() else {}
    write_json(path, {**info, "calibration": calibration})
    seal(path.parent)
    return path
