"""kronos qlib-tune on a rerun, on a tiny synthetic Qlib store: a finished study trains and forecasts nothing again
and writes the same report; an edited journal is refused (exit 5) naming it and the fix (the CSV study's check:
tests/test_tune.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from model.errors import EXIT_REFUSED
from tests.conftest import cpu_env
from tests.test_qlib_walk_forward import tiny_walk_forward_config

ROOT = Path(__file__).resolve().parents[1]


def qlib_tune(config: Path) -> subprocess.CompletedProcess:
    env = cpu_env(DIST_BACKEND="gloo", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "finetune.cli", "qlib-tune", "--config", str(config), "--device",
                           "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # ~3 min on 2 busy CPU cores: each unit trains both stages under torchrun
def test_a_qlib_study_rerun_redoes_nothing_and_refuses_an_edited_journal_naming_it_and_the_fix(tmp_path):
    """Two trials of a forecast-only key share one trained unit per period, each trial's signals sealed in a file of
    its own; each unit's trainers start once per stage (never only to skip a finished one). An unedited rerun
    re-checks the sealed files and starts no trainer and no forecast: no file under tune/units/ is written, and the
    report is byte-equal. Then the audit's edit: trial 1's value in tune/journal.log made -1 (the best). The rerun
    recomputes each complete trial from its units before any work: trial 0 matches, trial 1 is refused, exit 5,
    naming the journal and the fix; the report and the trained units are left as they were."""
    pytest.importorskip("qlib")
    cfg = tiny_walk_forward_config(tmp_path)
    cfg["walk_forward"]["test_range"] = ["2022-03-01", "2022-04-30"]  # one judged period
    cfg["tune"] = {"n_trials": 2, "inner_folds": 1, "heartbeat_seconds": 2,
                   "space": {"forecast.temperature": {"low": 0.6, "high": 1.4}}}
    config = tmp_path / "tune.yaml"
    config.write_text(yaml.safe_dump(cfg))
    first = qlib_tune(config)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = tmp_path / "models" / "tune"
    report = json.loads((out / "report.json").read_text())
    assert report["trials"]["complete"] == 2 and "verdict: " in first.stdout
    weights = {p: p.stat().st_mtime_ns for p in out.glob("units/*/finetune_*/best_model/model.safetensors")}
    assert len(weights) == 2 * 2  # (inner + judged period) x (tokenizer, predictor)
    temperatures = {t["settings"]["forecast.temperature"] for t in report["trials"]["list"]}
    assert len(temperatures) == 2  # trial 0's (the config's) and trial 1's
    units = sorted(p for p in (out / "units").iterdir() if p.is_dir())
    signals = [sorted(p.name for p in unit.glob("signals_*.csv")) for unit in units]
    judged = 1 if report["selected"]["defaults"] else 2  # the tuned and the given settings' (one file if the same)
    assert sorted(map(len, signals)) == sorted([2, judged])  # the inner period: one per trial
    assert all((unit / f"{name}.record.json").is_file() for unit, names in zip(units, signals) for name in names)
    for unit in units:  # one start per stage: "done." closes each trainer's run, a skip would say "finished run"
        log = (unit / "train.log").read_text()
        assert log.count("INFO done.") == 2 and "already holds a finished run" not in log, log[-2000:]

    files = lambda: {p: p.stat().st_mtime_ns for p in (out / "units").rglob("*")  # noqa: E731
                     if p.is_file() and p.suffix != ".lock"}  # a lock is opened (truncated) on every visit
    made, kept = files(), (out / "report.json").read_bytes()
    again = qlib_tune(config)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert files() == made  # no trainer started (train.log untouched), no signals forecast or rewritten
    assert (out / "report.json").read_bytes() == kept

    journal = out / "journal.log"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    edited = [r for r in records if r.get("trial_id") == 1 and r.get("state") == 1]
    assert len(edited) == 1  # the record that completes trial 1
    edited[0]["values"] = [-1.0]
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    rerun = qlib_tune(config)
    errors = [line for line in rerun.stderr.splitlines() if line.startswith("error")]
    assert rerun.returncode == EXIT_REFUSED and "Traceback" not in rerun.stderr, rerun.stderr[-3000:]
    assert errors == [f"error: {journal}: trial 1's recorded settings or scores (value -1.0) are not what its units' "
                      "files give: the study record was edited or damaged; delete it (or restore a copy) and rerun: "
                      "tune/units/ stays, so the study re-runs reusing every unit"]
    assert (out / "report.json").read_bytes() == kept
    assert {p: p.stat().st_mtime_ns for p in weights} == weights  # nothing trained again
