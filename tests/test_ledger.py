"""The ledger (finetune/utils/ledger.py) decides every reuse: an artifact is reused only while it is current for
the inputs of this run, rebuilt (the log says why) when they changed, refused when damaged (issue 30)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import finetune.utils.stages as stages
from finetune.utils.ledger import check_record, plan_run, write_record
from tests.test_csv_train import make_run
from tests.test_safety_stage_boundaries import outputs, run


def test_resume_required_before_the_first_checkpoint_starts_the_stage(tmp_path):
    # A kill before the stage's first checkpoint leaves run_info.json / metrics.jsonl but nothing to continue.
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "run_info.json").write_text("{}")
    plan = plan_run(tmp_path, "required", False, "predictor")
    assert plan.action == "fresh" and set(plan.remove) == {"metrics.jsonl", "run_info.json"}
    assert "starting over" in plan.message


def test_a_file_record_reuses_only_current_intact_bytes(tmp_path, caplog):
    path = tmp_path / "signals.csv"
    path.write_text("a,b\n1,2\n3,4\n")
    write_record(path, {"predictor": "abc", "lookback": 8})
    assert check_record(path, {"predictor": "abc", "lookback": 8}) == "reuse"
    assert check_record(path, {"predictor": "abd", "lookback": 8}) == "rebuild"
    assert "predictor: 'abc' -> 'abd'" in caplog.text
    path.write_text("a,b\n1,2\n")  # cut by a kill mid-write
    assert check_record(path, {"predictor": "abc", "lookback": 8}) == "rebuild"
    assert "damaged or edited" in caplog.text
    assert check_record(tmp_path / "missing.csv", {}) == "rebuild"


def _stop_before_calibration(monkeypatch, config: Path) -> None:
    """Run until the predictor finished, then SIGTERM as its calibration starts (exit 75, nothing calibrated)."""
    sample = stages.sample_paths

    def signal_then_sample(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return sample(*args, **kwargs)

    monkeypatch.setattr(stages, "sample_paths", signal_then_sample)
    assert run(config) == 75
    monkeypatch.undo()


def test_skip_existing_after_a_stop_before_calibration_on_edited_data_retrains_before_calibrating(
        tmp_path, monkeypatch, caplog, one_thread):
    """Issue 30 item 2: the finished but uncalibrated predictor was trained on the old CSV; --skip-existing on the
    edited CSV must not calibrate it on the new data: both stages train again, as an uninterrupted run would."""
    config = make_run(tmp_path)
    _stop_before_calibration(monkeypatch, config)
    make_run(tmp_path, n_bars=200)  # the CSVs edited in place: fewer bars
    assert run(config, "--skip-existing") == 0
    assert "no longer current (the training data changed" in caplog.text
    fresh = tmp_path / "fresh"
    assert run(make_run(fresh, n_bars=200)) == 0
    assert outputs(tmp_path) == outputs(fresh)
