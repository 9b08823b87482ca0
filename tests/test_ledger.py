"""The ledger (finetune/utils/ledger.py) decides every reuse: an artifact is reused only while it is current for
the inputs of this run, rebuilt (the log says why) when they changed, refused when damaged (issue 30)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import finetune.utils.stages as stages
import finetune_csv.pipeline as pipeline
from finetune.utils.errors import run_main
from finetune.utils.ledger import check_record, plan_run, write_record
from finetune_csv import walk_forward as wf
from model.errors import RefusedError
from tests.test_csv_train import make_run
from tests.test_safety_stage_boundaries import outputs, run
from tests.test_walk_forward import run_config  # noqa: F401 - the two-fold walk-forward fixture


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
    sample = pipeline.sample_paths

    def signal_then_sample(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return sample(*args, **kwargs)

    monkeypatch.setattr(pipeline, "sample_paths", signal_then_sample)
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


def _cut_csvs(folder: Path, bars: int) -> None:
    """Remove the last `bars` rows of every CSV in `folder` (as a user replacing the data with a shorter export)."""
    for path in folder.glob("*.csv"):
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[:-bars]))


def _report(root: Path) -> tuple[dict, bytes]:
    out = root / "wf" / "walk_forward"
    report = json.loads((out / "report.json").read_text())
    return {k: report[k] for k in ("paired", "verdict")} | {"scores": [f["scores"] for f in report["folds"]],
                                                              "dates": [f["test_start"] for f in report["folds"]]}, \
        (out / "windows.csv").read_bytes()


def test_a_walk_forward_stopped_after_fold_0_then_run_on_cut_data_retrains_fold_0(
        run_config, tmp_path, monkeypatch, caplog, one_thread):  # noqa: F811
    """Issue 30 item 1: the fold-0 predictor trained on the longer data must not be reused once the data is cut (its
    training period then overlaps fold 0's new test block): the re-run retrains it and ends as a fresh run on the
    cut data."""
    real = stages.train_predictor

    def stop_after(*args, **kwargs):
        value = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return value

    monkeypatch.setattr(stages, "train_predictor", stop_after)
    assert run_main(wf.main, ["--config", str(run_config)]) == 75
    monkeypatch.undo()
    _cut_csvs(tmp_path / "data", 16)
    assert run_main(wf.main, ["--config", str(run_config)]) == 0
    assert "fold_0/basemodel holds a finished run that is no longer current (the training data changed" in caplog.text
    reference = tmp_path / "reference.yaml"
    reference.write_text(run_config.read_text().replace(str(tmp_path / "out"), str(tmp_path / "ref")))
    assert run_main(wf.main, ["--config", str(reference)]) == 0
    assert _report(tmp_path / "out") == _report(tmp_path / "ref")


def test_report_only_refuses_a_cut_windows_csv_and_a_rerun_rescores_it(run_config, tmp_path, one_thread):  # noqa: F811
    """Issue 30 item 6: a fold's windows.csv cut to half its rows is not what its fold.json recorded."""
    assert run_main(wf.main, ["--config", str(run_config)]) == 0
    expected = _report(tmp_path / "out")
    rows = tmp_path / "out/wf/walk_forward/fold_0/windows.csv"
    lines = rows.read_text().splitlines(keepends=True)
    rows.write_text("".join(lines[: len(lines) // 2]))
    with pytest.raises(RefusedError, match=r"--report-only: .*fold_0 .*windows.csv is not the file fold.json recorded"):
        wf.main(["--config", str(run_config), "--report-only"])
    assert run_main(wf.main, ["--config", str(run_config)]) == 0
    assert _report(tmp_path / "out") == expected


def test_qlib_signals_csv_cut_by_a_kill_is_rebuilt_not_reused(tmp_path, monkeypatch):
    """Issue 30 item 5: signals.csv is written atomically, recorded, and a copy cut to 37% of its bytes (a kill
    mid-write under the old code) is forecast again instead of read back."""
    import pandas as pd

    from finetune import qlib_walk_forward as qwf
    from finetune.config import load as load_qlib
    from tests.model_factory import tiny_models
    from tests.test_qlib_pipeline import tiny_config

    c = load_qlib(tiny_config(tmp_path))
    best = tmp_path / "best_model"
    best.mkdir()
    (best / "model.safetensors").write_bytes(b"weights")
    c.paths.finetuned_predictor_path = str(best)
    index = pd.MultiIndex.from_product([pd.date_range("2022-01-03", periods=50), [f"SH{i}" for i in range(40)]],
                                       names=["datetime", "instrument"])
    table = pd.DataFrame({"mean/finetuned": range(2000), "mean/zero_shot": range(2000)}, index=index) / 7.0
    calls = []
    monkeypatch.setattr(qwf, "forecast_signals", lambda *args: calls.append(1) or table)
    zero = tiny_models()
    first = qwf.period_signals(c, tmp_path, zero, "cpu")
    assert len(calls) == 1 and not list(tmp_path.glob("*.tmp*"))
    pd.testing.assert_frame_equal(qwf.period_signals(c, tmp_path, zero, "cpu"), first, check_freq=False)
    assert len(calls) == 1  # current: read back
    data = (tmp_path / "signals.csv").read_bytes()
    (tmp_path / "signals.csv").write_bytes(data[: int(len(data) * 0.37)])
    again = qwf.period_signals(c, tmp_path, zero, "cpu")
    assert len(calls) == 2 and len(again) == 2000 and not again.isna().any().any()
    (best / "model.safetensors").write_bytes(b"retrained")  # a new predictor: its signals are forecast again
    qwf.period_signals(c, tmp_path, zero, "cpu")
    assert len(calls) == 3


def test_the_store_records_the_hash_of_the_bytes_it_parsed_while_the_csv_is_replaced_in_a_loop(tmp_path):
    """Issue 30 item 3: with another process replacing the CSV between two versions (the second with prices x2),
    every build records the sha256 of the version it holds, never of the other one."""
    import hashlib
    import threading

    from finetune.synthetic import generate_ohlcv
    from finetune.utils.store import open_store
    from finetune_csv.prepare import prepare_store

    frame = generate_ohlcv(n_series=1, n_bars=3000, freq="5min", seed=0)["SH600000"]
    doubled = frame.copy()
    for col in ("open", "high", "low", "close"):
        doubled[col] *= 2
    versions = [frame.to_csv(index=False).encode(), doubled.to_csv(index=False).encode()]
    sha = [hashlib.sha256(v).hexdigest() for v in versions]
    path = tmp_path / "data" / "SH600000.csv"
    path.parent.mkdir()
    path.write_bytes(versions[0])
    stop = threading.Event()

    def replace_in_a_loop():
        k = 0
        while not stop.is_set():
            k ^= 1
            (tmp_path / "next.csv").write_bytes(versions[k])
            os.replace(tmp_path / "next.csv", path)

    writer = threading.Thread(target=replace_in_a_loop)
    writer.start()
    try:
        held = []
        for i in range(30):
            info = prepare_store(path, tmp_path / f"store_{i}")
            version = sha.index(info.manifest["sources"][0]["sha256"])
            close = float(open_store(info.path).features[3, 0])  # (6, N) float32: the first close
            held.append(version)
            assert close == pytest.approx(float(frame["close"].iloc[0]) * (1 + version), rel=1e-6), i
    finally:
        stop.set()
        writer.join()
    assert len(set(held)) == 2  # both versions were built while the file changed


def test_forecasts_after_a_stop_before_calibration_say_so_and_other_data_goes_beside_the_run(
        tmp_path, monkeypatch, caplog, capsys, one_thread):
    """Issue 30 items 4, 8 and 9: an uncalibrated finished predictor is announced as such (naming the fix); a
    *.tmp left by a killed forecast does not survive the next one; a forecast on other data than the run's says so
    and writes beside the run's folders, never over them."""
    from finetune.synthetic import generate_ohlcv, write_csv_folder
    from finetune_csv import forecast

    config = make_run(tmp_path)
    _stop_before_calibration(monkeypatch, config)
    assert run_main(forecast.main, ["--config", str(config)]) == 0
    assert "finished but its bands were never calibrated" in caplog.text and "`kronos finetune` again" in caplog.text
    from model import KronosPredictor

    best = tmp_path / "out" / "tiny" / "basemodel" / "best_model"
    caplog.clear()
    assert KronosPredictor.from_pretrained(best).calibration is None
    assert "holds no calibration" in caplog.text and "`kronos finetune`" in caplog.text
    assert run(config) == 0  # calibrates it
    caplog.clear()
    assert KronosPredictor.from_pretrained(best).calibration and "holds no calibration" not in caplog.text
    out = tmp_path / "out" / "tiny"
    (out / "forecast" / ".forecast.csv.k1ll3d.tmp").write_text("half")
    assert run_main(forecast.main, ["--config", str(config)]) == 0
    assert "never calibrated" not in caplog.text and not list((out / "forecast").glob("*.tmp"))
    kept = {p: p.read_bytes() for p in [*(out / "forecast").iterdir(), *(out / "data_store").rglob("*")]
            if p.is_file()}
    write_csv_folder(generate_ohlcv(n_series=2, n_bars=240, freq="5min", seed=9), tmp_path / "other")
    capsys.readouterr()
    assert run_main(forecast.main, ["--config", str(config), "--set", f"data.path={tmp_path / 'other'}"]) == 0
    assert "forecasting with other data or settings than the run" in caplog.text
    assert {p: p.read_bytes() for p in kept} == kept  # the run's forecast and data store untouched
    beside = [p for p in out.iterdir() if p.is_dir() and p.name.startswith("forecast_")]
    assert len(beside) == 1 and (beside[0] / "metrics.json").is_file()
    assert f"written: {beside[0]}/" in capsys.readouterr().out
