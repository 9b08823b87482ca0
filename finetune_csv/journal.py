"""The forecast journal: every `kronos forecast --future` (and served) forecast appended under <base_dir>/journal/,
and `kronos track`, which scores the journaled forecasts whose outcomes have arrived in data.path since.

    kronos track --config configs/csv_demo.yaml"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
from safetensors.torch import load_file

from finetune.evaluation.forecast_scores import crps_ensemble
from finetune.utils.cli_args import add_config_args, parse_config_args
from finetune.utils.errors import setup_logging
from finetune.utils.fingerprint import digest
from finetune_csv.config import CsvFinetuneConfig, best_dir, load
from finetune_csv.prepare import prepare_data
from model import adaptive
from model.calibration import write_calibration
from model.errors import DataError
from model.features import CLOSE
from model.fileio import check_seal, read_json_object, write_json
from model.hub import WEIGHTS_NAME, weights_fingerprint
from model.predictor import PREDICTOR_INFO_NAME, read_predictor_info

log = logging.getLogger(__name__)
LEVELS = (0.5, 0.8, 0.9, 0.95)  # central bands whose live coverage is tracked
NOT_IN_DATA = "no such series in data.path (a served id, or a series removed from it)"


def journal_records(
    model: dict,
    settings: dict,
    names: list[str],
    origins: list,
    last: np.ndarray,
    raw: np.ndarray,
    paths: np.ndarray,
    margins: list | None = None,
) -> list[dict]:
    """One record per series of a forecast: `model` {"folder", "predictor_sha256", ...}, `settings` the request's,
    `origins` each series' last bar time, `last (N,)` its close, `raw (N, S, H)` the sampled closes, `paths (N, S, H)`
    the published (calibrated) ones, `margins` [(L, H) margins applied per series] or None (raw bands)."""
    q = lambda p: np.quantile(p, adaptive.SCORE_LEVELS, axis=1)  # noqa: E731 - (Q, N, H)
    qr, qc = q(raw), q(paths)
    out = []
    for i, name in enumerate(names):
        rec = {
            "series": name,
            "origin": pd.Timestamp(origins[i]).isoformat(),
            "model": model,
            "settings": settings,
            "last_close": float(last[i]),
            "levels": list(adaptive.SCORE_LEVELS),
            "raw_quantiles": qr[:, i].tolist(),
            "quantiles": qc[:, i].tolist(),
            "samples": paths[i].tolist(),
            "margins": None if margins is None else np.asarray(margins[i]).tolist(),
        }
        out.append({"id": digest(rec)[:16], **rec})
    return out


def append_forecasts(base_dir: str | os.PathLike, records: list[dict]) -> Path:
    """Append `records` (journal_records') to <base_dir>/journal/forecasts.jsonl, one JSON line each, flushed to
    disk; returns its path. Never rewrites a line."""
    path = Path(base_dir) / "journal" / "forecasts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())
    return path


def read_journal(path: Path) -> list[dict]:
    """The journal's records, each once (a forecast repeated bit for bit is one forecast)."""
    seen: dict[str, dict] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rec = json.loads(line)
            seen.setdefault(rec["id"], rec)
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path}: line {n} is not a journal record; restore the file (it is append-only)") from None
    return list(seen.values())


def track(cfg: CsvFinetuneConfig) -> dict:
    """Score every journaled forecast step whose bar has arrived (the j-th bar after its origin in data.path), per
    model (a forecast of a series data.path lacks is counted in "unscored"); feed the steps not fed before, in
    publication order, to the adaptive state of the model that made them when it is the current one (all of them
    again when `kronos forecast` rebuilt the state since: its digest is not the one track.json records); write
    journal/track.json and journal/track.html. Same data: same files."""
    folder = cfg.base_dir / "journal"
    if not (folder / "forecasts.jsonl").is_file():
        raise DataError(f"no forecast journal in {folder}; run `kronos forecast --future` first")
    records = read_journal(folder / "forecasts.jsonl")
    panel = prepare_data(cfg.data, folder / "store", with_splits=False).panel  # data.path as it is now
    bars = {
        n: (
            pd.DatetimeIndex(np.asarray(panel.datetimes[panel.rows(s)]).astype("datetime64[ns]")),
            np.asarray(panel.features[CLOSE, panel.rows(s)], dtype=np.float64),
        )
        for s, n in enumerate(panel.names)
    }
    before = read_json_object(folder / "track.json") if (folder / "track.json").is_file() else {}
    rows, missing = [], []
    unscored = Counter(rec["series"] for rec in records if rec["series"] not in bars)
    for rec in (rec for rec in records if rec["series"] in bars):
        times, close = bars[rec["series"]]
        at = times.get_indexer([pd.Timestamp(rec["origin"]).tz_localize(None)])[0]
        if at < 0:
            missing.append(f"{rec['series']} {rec['origin']}")
            continue
        lv, qc, qr = np.asarray(rec["levels"]), np.asarray(rec["quantiles"]), np.asarray(rec["raw_quantiles"])
        for j in range(min(len(qc[0]), len(times) - at - 1)):
            y, last = close[at + j + 1], rec["last_close"]
            row = {
                "id": rec["id"],
                "step": j,
                "model": rec["model"]["predictor_sha256"],
                "series": rec["series"],
                "origin": rec["origin"],
                "arrived": times[at + j + 1].isoformat(),
                "crps": float(
                    crps_ensemble(np.array(y / last - 1), np.asarray(rec["samples"])[:, j] / last - 1, fair=True)
                ),
                "persistence_crps": abs(y / last - 1),
                "calibrated": rec.get("margins") is not None,  # raw bands (other sampling when served): not fed
            }
            for c in LEVELS:
                lo, hi = (qc[np.argmin(np.abs(lv - x)), j] for x in ((1 - c) / 2, (1 + c) / 2))
                row[f"cov{round(c * 100)}"] = float(lo <= y <= hi)
            row["score"] = adaptive.band_scores(np.log(qr[:, j : j + 1] / last), np.log(np.array([y / last])))[:, 0]
            rows.append(row)
    if missing:
        raise DataError(
            f"journaled forecasts whose origin bar is no longer in data.path: {missing[:5]}; point "
            "data.path at the data they were made from (with the new bars appended)"
        )
    rows.sort(key=lambda r: (r["arrived"], r["origin"], r["series"], r["step"]))  # publication order
    best = best_dir(cfg.predictor_dir)
    check_seal(best, "train it again (training.overwrite=true) or copy the model again")
    # the journal's weights_fingerprint(model) without building the model: its state dict is the file's tensors
    # loaded into float32 parameters (forecasts of a replaced model keep their own fingerprint)
    current = weights_fingerprint({k: v.float() if v.is_floating_point() else v
                                   for k, v in load_file(best / WEIGHTS_NAME).items()})
    calibration = read_predictor_info(best).get("calibration")
    fed, state = set(before.get("fed", [])), None
    if calibration is not None and cfg.forecast.calibration_method == "adaptive":
        state = calibration.get("adaptive") or adaptive.start_state(calibration)
        rebuilt = before.get("adaptive_state") not in (None, digest(state))  # by `kronos forecast`: feed all again
        tracked = lambda name: adaptive.ALL in state["trackers"] or name in state["trackers"]  # noqa: E731
        new = [r for r in rows if r["model"] == current and r["calibrated"] and tracked(r["series"])
               and (rebuilt or f"{r['id']}:{r['step']}" not in fed)]
        if again := sum(f"{r['id']}:{r['step']}" in fed for r in new):
            log.warning("the adaptive state was rebuilt since the last track (kronos forecast?): %d live outcomes fed "
                        "again", again)
        for r in new:
            adaptive.update(state, r["score"], r["step"], r["series"])
            fed.add(f"{r['id']}:{r['step']}")
        if new:
            write_calibration(best / PREDICTOR_INFO_NAME, {**calibration, "adaptive": state})
    held = cfg.base_dir / "forecast" / "metrics.json"
    held = read_json_object(held) if held.is_file() else {}
    report = {"forecasts": len(records), "scored_steps": len(rows), "fed": sorted(fed), "models": {},
              "adaptive_state": digest(state) if state else before.get("adaptive_state"),  # what track left:
              # another one next time was rebuilt (kept through a track without an adaptive state)
              "unscored": {s: {"forecasts": n, "reason": NOT_IN_DATA} for s, n in sorted(unscored.items())}}
    for sha in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == sha]
        n, cov80 = len(mine), float(np.mean([r["cov80"] for r in mine]))
        hits = np.cumsum([r["cov80"] for r in mine]).tolist()  # 80% hits so far (0/1 sums: exact prefix means)
        p = ((held.get("calibration") or {}).get("cov80_calibrated") if sha == current else None) or 0.8
        allowed = [p - 1.96 * (p * (1 - p) / n) ** 0.5, p + 1.96 * (p * (1 - p) / n) ** 0.5]
        report["models"][sha] = {
            "steps": n,
            "crps": float(np.mean([r["crps"] for r in mine])),
            "persistence_crps": float(np.mean([r["persistence_crps"] for r in mine])),
            "held_out_crps": ((held.get("finetuned") or {}).get("model") or {}).get("overall", {}).get("crps")
            if sha == current
            else None,
            **{f"cov{round(c * 100)}": float(np.mean([r[f"cov{round(c * 100)}"] for r in mine])) for c in LEVELS},
            "cov80_allowed": allowed,
            "warning": None
            if allowed[0] <= cov80 <= allowed[1]
            else f"live 80% coverage {cov80:.2f} outside [{allowed[0]:.2f}, {allowed[1]:.2f}] "
            f"(held-out {p:.2f}, {n} steps)",
            "cov80_over_time": [[r["arrived"], h / (k + 1)] for k, (r, h) in enumerate(zip(mine, hits))],
        }
    if report != before:  # a rerun on the same data changes nothing
        write_json(folder / "track.json", report)
        (folder / "track.html").write_text(page(report), encoding="utf-8")
    return report


def page(report: dict) -> str:
    """journal/track.html: the unscored line; per model, live CRPS beside the held-out figure, live coverage over time,
    the warning."""
    parts = ["<!doctype html><meta charset=utf-8><title>kronos track</title><h1>Live forecasts</h1>"]
    parts += [f"<p><b>{unscored_line(report)}</b></p>"] if report["unscored"] else []
    for sha, m in report["models"].items():
        parts.append(
            f"<h2>model {sha[:12]}</h2><p>{m['steps']} steps scored; CRPS {m['crps']:.5f} (held-out "
            f"{m['held_out_crps'] if m['held_out_crps'] is not None else '-'}, persistence "
            f"{m['persistence_crps']:.5f}); coverage 50/80/90/95%: {m['cov50']:.2f} / {m['cov80']:.2f} / "
            f"{m['cov90']:.2f} / {m['cov95']:.2f}</p>"
            + (f"<p><b>warning: {m['warning']}</b></p>" if m["warning"] else "")
        )
        parts.append(
            "<table><tr><th>arrived</th><th>80% coverage so far</th></tr>"
            + "".join(f"<tr><td>{t}</td><td>{c:.2f}</td></tr>" for t, c in m["cov80_over_time"])
            + "</table>"
        )
    return "\n".join(parts)


def unscored_line(report: dict) -> str:
    """The one line naming the journaled forecasts track could not score (their series is not in data.path)."""
    u, n = report["unscored"], sum(x["forecasts"] for x in report["unscored"].values())
    return (f"{n} journaled forecast{'s' * (n != 1)} not scored, {NOT_IN_DATA}: "
            + ", ".join(f"{s} ({x['forecasts']})" for s, x in u.items()))


def main(argv: list[str] | None = None) -> int:
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), CsvFinetuneConfig, load)
    args = parse_config_args(parser, argv)
    setup_logging()
    report = track(cfg := load(args.config, args.set))
    for sha, m in report["models"].items():
        print(
            f"model {sha[:12]}: {m['steps']} steps scored, CRPS {m['crps']:.5f}, 80% coverage {m['cov80']:.2f}"
            + (f"; warning: {m['warning']}" if m["warning"] else "")
        )
    if report["unscored"]:
        print(unscored_line(report))
    print(f"written: {cfg.base_dir}/journal/{{track.json, track.html}}")
    return 0


if __name__ == "__main__":
    from finetune.utils.errors import run_main

    sys.exit(run_main(main))
