"""Adaptive conformal calibration of the sampled bands: conformal PID control's quantile tracking with an integrator
(Angelopoulos, Candes, Tibshirani 2023) of the band-unit margins `fit_calibration` fits, per band level and horizon
step (optionally per series), each outcome used only once it is published. Design: docs/architecture.md, "Adaptive
bands"."""

from __future__ import annotations

from typing import Any

import numpy as np

from model.calibration import CALIBRATION_LEVELS, MAX_MARGIN, MIN_KEEP, calibration_margins
from model.errors import DataError

# The sampled quantile levels a band-unit score reads: (1 - c) / 2, 0.5, (1 + c) / 2 of every calibration level c.
SCORE_LEVELS = tuple(sorted({round(x, 4) for c in CALIBRATION_LEVELS for x in ((1 - c) / 2, 0.5, (1 + c) / 2)}))
# lr: a step of lr x (1 + split margin) per outcome (the split band's own width unit); ki, csat: the saturated
# integrator ki x tan(E log(n+1) / ((n+1) csat)) of the summed coverage errors E over n outcomes. Tuned on the
# acceptance data of docs/evaluation.md, "Adaptive bands".
GAINS = {"lr": 0.15, "ki": 0.5, "csat": 1.0}
ALL = "*"  # the tracker every series shares when per_series is off


def band_scores(quantiles: np.ndarray, outcome: np.ndarray) -> np.ndarray:
    """The score `fit_calibration` ranks: quantiles (..., len(SCORE_LEVELS), H) and outcome (..., H) in log-return
    units -> (..., L, H), how far past the central level-c band's edge the outcome lies in units of that half-band
    (<= 0 inside; the band widened by margin m covers iff score <= m)."""
    q = {lv: quantiles[..., k, :] for k, lv in enumerate(SCORE_LEVELS)}
    med = q[0.5]
    out = []
    for c in CALIBRATION_LEVELS:
        lo, hi = q[round((1 - c) / 2, 4)], q[round((1 + c) / 2, 4)]
        out.append(
            np.maximum((lo - outcome) / np.maximum(med - lo, 1e-12), (outcome - hi) / np.maximum(hi - med, 1e-12))
        )
    return np.stack(out, axis=-2)


def start_state(calibration: dict[str, Any], series: list[str] | None = None) -> dict[str, Any]:
    """A fresh adaptive state from a split calibration: one tracker (`series` None) or one per series, each at the
    split margins (L, H) with no coverage error summed yet."""
    _, margins = calibration_margins(calibration, "calibration")
    trackers = {  # new lists per tracker: `update` changes them in place
        name: {
            "q": margins.tolist(),
            "e": (0 * margins).tolist(),
            "n": [0] * margins.shape[1],
            "base": margins.tolist(),
        }
        for name in (series or [ALL])
    }
    return {"gains": dict(GAINS), "trackers": trackers, "through": None}


def tracker_margins(state: dict[str, Any], series: str | None = None) -> np.ndarray:
    """The margins (L, H) the state gives now for `series` (its own tracker, else the shared one): the tracked
    quantile plus the saturated integrator, within [MIN_KEEP - 1, MAX_MARGIN] (never an infinite or collapsed band)."""
    t, g = _tracker(state, series), state["gains"]
    q, e, base = (np.asarray(t[k], dtype=np.float64) for k in ("q", "e", "base"))
    n = np.asarray(t["n"], dtype=np.float64)[None, :] + 1  # (1, H)
    arg = np.clip(e * np.log(n + 1) / (n * g["csat"]), -1.4, 1.4)  # tan stays finite: the integrator saturates
    return np.clip(q + g["ki"] * (1 + base) * np.tan(arg) * (n > 1), MIN_KEEP - 1, MAX_MARGIN)


def update(state: dict[str, Any], score: np.ndarray, step: int, series: str | None = None) -> None:
    """Feed one published outcome: `score` (L,) band-unit scores of horizon step `step` (0-based) of one forecast."""
    t, g = _tracker(state, series), state["gains"]
    miss = np.asarray(score) > tracker_margins(state, series)[:, step]
    err = miss - (1 - np.asarray(CALIBRATION_LEVELS))  # (L,) > 0 when missing more often than 1 - c allows
    for k, row in enumerate(t["q"]):
        row[step] = float(np.clip(row[step] + g["lr"] * (1 + t["base"][k][step]) * err[k], MIN_KEEP - 1, MAX_MARGIN))
        t["e"][k][step] += float(err[k])
    t["n"][step] += 1


def _tracker(state: dict[str, Any], series: str | None) -> dict[str, Any]:
    trackers = state["trackers"]
    if ALL in trackers:
        return trackers[ALL]
    if series not in trackers:
        raise DataError(
            f"the adaptive calibration tracks series {sorted(trackers)}, not {series!r}; refit it with "
            "forecast.per_series: false, or forecast with forecast.calibration_method: split"
        )
    return trackers[series]


def replay(
    state: dict[str, Any], scores: np.ndarray, origins: np.ndarray, arrivals: np.ndarray, series: list[str]
) -> np.ndarray:
    """Held-out windows in publication order: `scores (W, L, H)` of each window's raw bands, `origins (W,)` the
    times each was forecast, `arrivals (W, H)` the times its outcomes are published, `series (W,)`. Window w gets the
    margins of the outcomes published by its origin (arrival <= origin); all of them are fed by the end (the state
    then continues past the test). Returns the margins each window was calibrated with, (W, L, H); `state` updated."""
    order = np.argsort(arrivals, axis=None, kind="stable")  # events (w, step) in publication order
    ev_w, ev_step = np.unravel_index(order, arrivals.shape)
    ev_t, done = arrivals.ravel()[order], 0
    margins = np.empty(scores.shape)
    for w in np.argsort(origins, kind="stable"):
        while done < len(order) and ev_t[done] <= origins[w]:
            update(state, scores[ev_w[done], :, ev_step[done]], ev_step[done], series[ev_w[done]])
            done += 1
        margins[w] = tracker_margins(state, series[w])
    for k in range(done, len(order)):
        update(state, scores[ev_w[k], :, ev_step[k]], ev_step[k], series[ev_w[k]])
    state["through"] = str(ev_t[-1]) if len(ev_t) else state["through"]
    return margins


def with_margins(calibration: dict[str, Any], margins: np.ndarray) -> dict[str, Any]:
    """The calibration `apply_calibration` reads, carrying `margins (L, H)` instead of the split ones."""
    return {k: v for k, v in calibration.items() if k != "adaptive"} | {"margins": np.asarray(margins).tolist()}


def current_calibration(calibration: dict[str, Any] | None, series: str | None = None) -> dict[str, Any] | None:
    """What a forecast made now applies: the stored adaptive state's margins for `series` when the calibration holds
    one (kronos_predictor.json "calibration"."adaptive"), else the split calibration as stored. A series the
    per-series state holds no tracker for (no held-out windows; an id a served request names) gets the split margins
    the trackers started from, not an error."""
    state = calibration and calibration.get("adaptive")
    if not state:
        return calibration
    if ALL not in state["trackers"] and series not in state["trackers"]:
        return {k: v for k, v in calibration.items() if k != "adaptive"}
    return with_margins(calibration, tracker_margins(calibration["adaptive"], series))
