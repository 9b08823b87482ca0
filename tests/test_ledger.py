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


@pytest.mark.slow  # two walk-forward runs
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
    with pytest.raises(RefusedError, match=r"--report-only: .*fold_0 .*windows.csv is not the one fold.json recorded"):
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


# ---- issue 44: every input in the fingerprint, one rule for every path
def test_every_training_setting_has_a_resume_class():
    """A setting added to TrainingConfig without a class would be compared by nobody (issue 40 item 5)."""
    from dataclasses import fields

    from finetune.utils.schema import RESUME_CLASS, TrainingConfig

    assert set(RESUME_CLASS) == {f.name for f in fields(TrainingConfig)}
    assert RESUME_CLASS["deterministic"] == "may_change" and RESUME_CLASS["num_workers"] == "irrelevant"


@pytest.mark.slow
def test_a_changed_optimisation_setting_is_named_with_and_without_skip_existing(tmp_path, caplog):
    """Issue 44 cause 2: a finished run made with another weight decay is not current: a plain run refuses it by
    name (nothing deleted), --skip-existing (rebuild_changed) retrains it by name; both end as a fresh run would."""
    from dataclasses import replace

    from finetune.utils.training_utils import train_tokenizer
    from model.errors import ConfigError
    from tests.test_safety_engine import CFG, CPU, tiny_datasets, tiny_tokenizer

    train_set, val_set = tiny_datasets()
    cfg = replace(CFG, epochs=1)
    first = train_tokenizer(tiny_tokenizer(), train_set, val_set, cfg, tmp_path / "a", CPU)
    weights = (first.best_model_dir / "model.safetensors").read_bytes()
    changed = replace(cfg, weight_decay=0.05)
    with pytest.raises(ConfigError, match=r"training\.weight_decay: the run was made with 0\.1, the config now says "
                                          r"0\.05"):
        train_tokenizer(tiny_tokenizer(), train_set, val_set, changed, tmp_path / "a", CPU)
    assert (first.best_model_dir / "model.safetensors").read_bytes() == weights  # kept
    again = train_tokenizer(tiny_tokenizer(), train_set, val_set, changed, tmp_path / "a", CPU, rebuild_changed=True)
    assert not again.skipped and "no longer current (training.weight_decay: 0.1 -> 0.05)" in caplog.text
    fresh = train_tokenizer(tiny_tokenizer(), train_set, val_set, changed, tmp_path / "b", CPU)
    assert (again.best_model_dir / "model.safetensors").read_bytes() == \
        (fresh.best_model_dir / "model.safetensors").read_bytes() != weights
    assert train_tokenizer(tiny_tokenizer(), train_set, val_set, changed, tmp_path / "a", CPU).skipped  # current


@pytest.mark.slow
def test_changed_starting_weights_in_place_or_elsewhere_are_named_never_reused(tmp_path, capsys, one_thread):
    """Issue 44 cause 1: model.pretrained_predictor overwritten in place, then pointed at other weights: a plain run
    refuses the finished predictor naming the start (its weights kept), --skip-existing retrains it, as a fresh run
    on the new start would."""
    from tests.model_factory import tiny_predictor, tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    tiny_predictor().save_pretrained(tmp_path / "pred")
    common = ["--set", f"model.pretrained_tokenizer={tmp_path / 'tok'}", "--set", "tokenizer_training.epochs=0"]
    start = ["--set", f"model.pretrained_predictor={tmp_path / 'pred'}"]
    config = make_run(tmp_path)
    assert run(config, *common, *start) == 0
    best = tmp_path / "out/tiny/basemodel/best_model/model.safetensors"
    old = best.read_bytes()
    tiny_predictor(seed=7).save_pretrained(tmp_path / "pred")  # overwritten in place
    capsys.readouterr()
    assert run(config, *common, *start) == 5
    err = capsys.readouterr().err
    assert "the starting weights changed (model.pretrained_predictor" in err and best.read_bytes() == old
    assert run(config, *common, *start, "--skip-existing") == 0
    assert "no longer current (the starting weights changed" in capsys.readouterr().err
    fresh = make_run(tmp_path / "fresh")
    assert run(fresh, *common, *start) == 0
    assert best.read_bytes() == (tmp_path / "fresh/out/tiny/basemodel/best_model/model.safetensors").read_bytes()
    tiny_predictor().save_pretrained(tmp_path / "elsewhere")  # pointed at other (the first) weights
    assert run(config, *common, "--set", f"model.pretrained_predictor={tmp_path / 'elsewhere'}") == 5
    assert "the starting weights changed (model.pretrained_predictor" in capsys.readouterr().err


@pytest.mark.slow
def test_a_moved_identical_data_folder_is_the_same_data(tmp_path, caplog, one_thread):
    """Issue 44: fingerprints hold content, not resolved paths: the finished run is reused after the folder moved."""
    config = make_run(tmp_path)
    assert run(config) == 0
    before = outputs(tmp_path)
    (tmp_path / "data").rename(tmp_path / "moved")
    caplog.clear()
    assert run(config, "--set", f"data.path={tmp_path / 'moved'}") == 0
    assert caplog.text.count("already holds a finished run; skipping it") == 2
    assert "  predictor: reuse the finished run in" in caplog.text and "predictor: train" not in caplog.text  # plan
    assert outputs(tmp_path) == before


@pytest.mark.slow
def test_a_qlib_source_rebuilt_in_place_is_noticed(tmp_path):
    """Issue 44 cause 5: a new market written to the same qlib_data_path: the splits made from the old one are
    named as stale (the walk-forward then preprocesses again) instead of being scored against the new labels."""
    pytest.importorskip("qlib")
    from finetune.config import load as load_qlib
    from finetune.dataset import check_processed
    from finetune.qlib_builder import build_qlib_provider
    from finetune.qlib_data_preprocess import preprocess
    from finetune.synthetic import generate_ohlcv
    from finetune.utils.config_utils import Problems
    from tests.test_qlib_pipeline import tiny_config

    market = lambda seed: generate_ohlcv(4, None, "1D", start="2021-01-04", end="2022-06-30", seed=seed)  # noqa: E731
    build_qlib_provider(market(3), tmp_path / "qlib", universe="csi300", benchmark="SH000300")
    cfg = load_qlib(tiny_config(tmp_path))
    preprocess(cfg)
    problems = Problems()
    check_processed(cfg, ("train", "val", "test"), problems)
    assert not problems
    build_qlib_provider(market(4), tmp_path / "qlib", universe="csi300", benchmark="SH000300", overwrite=True)
    check_processed(cfg, ("train", "val", "test"), problems)
    assert len(problems.items) == 1 and problems.items[0].startswith("data.qlib_data_path: its content changed")


def test_a_fold_names_the_changed_part_and_a_windows_csv_edit_keeping_count_and_means_is_caught(tmp_path, caplog):
    """Issue 44 causes 1 and 4 in the CSV walk-forward: fold.json's fingerprint part by part (a new starting model is
    named), windows.csv checked by its bytes (two CRPS values swapped keep the count and every mean)."""
    from model.fileio import write_json

    folder = tmp_path / "fold_0"
    folder.mkdir()
    (folder / "windows.csv").write_text("candidate,crps\nfinetuned,0.1\nfinetuned,0.2\n")
    fp = {"settings": "s", "ranges": "r", "data": "d", "model.pretrained_predictor": "a"}
    write_json(folder / "fold.json", {"fingerprint": fp, "windows_sha256": wf.sha256_file(folder / "windows.csv")})
    assert wf._reuse_fold(folder, fp, report_only=False, overwrite=False)["fingerprint"] == fp
    with pytest.raises(RefusedError, match=r"made with other model\.pretrained_predictor; pass --overwrite"):
        wf._reuse_fold(folder, {**fp, "model.pretrained_predictor": "b"}, report_only=False, overwrite=False)
    (folder / "windows.csv").write_text("candidate,crps\nfinetuned,0.2\nfinetuned,0.1\n")
    assert wf._reuse_fold(folder, fp, report_only=False, overwrite=False) is None
    assert "windows.csv is not the one fold.json recorded" in caplog.text
