"""Nothing lost to an interruption between the stages: a SIGTERM right after the tokenizer's last epoch or while
the predictor's bands are calibrated stops the CSV run with exit 75 and one line, and a kill between "predictor
finished" and "calibration written" is calibrated by the next run (the default re-run, --skip-existing, --resume);
each re-run ends with exactly the uninterrupted run's models and calibration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import finetune.utils.stages as stages
import finetune_csv.pipeline as pipeline
from finetune.utils.errors import run_main
from finetune.utils.safety import STOPPED_EXIT_CODE, GracefulStop
from finetune_csv import train_sequential
from tests.test_csv_train import REPO, env_one_thread, make_run

OUTPUTS = ("tokenizer/best_model/model.safetensors", "basemodel/best_model/model.safetensors",
           "basemodel/best_model/tokenizer/model.safetensors")


def run(config: Path, *flags: str) -> int:
    return run_main(train_sequential.main, ["--config", str(config), *flags])


def outputs(root: Path) -> dict:
    """The models' bytes and the predictor's kronos_predictor.json (window, tokenizer sha256, calibration)."""
    out = root / "out" / "tiny"
    got = {name: (out / name).read_bytes() for name in OUTPUTS}
    got["info"] = json.loads((out / "basemodel/best_model/kronos_predictor.json").read_text())
    got["info"].pop("tokenizer")  # a path relative to the run's own folder
    return got


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run(make_run(root)) == 0
    finally:
        torch.set_num_threads(threads)
    expected = outputs(root)
    assert expected["info"]["calibration"]["windows"] > 0 and len(expected["info"]["tokenizer_sha256"]) == 64
    return expected


def sigterm_after(monkeypatch, name: str) -> None:
    """SIGTERM this process right after `stages.<name>` returns (as a scheduler's signal landing then would)."""
    real = getattr(stages, name)

    def then_signal(*args, **kwargs):
        value = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return value

    monkeypatch.setattr(stages, name, then_signal)


@pytest.mark.slow  # a stopped run and its rerun, after the uninterrupted one (the module fixture)
def test_sigterm_after_the_tokenizer_stage_stops_before_the_predictor_and_the_rerun_finishes_it(
        tmp_path, uninterrupted, monkeypatch, capsys, one_thread):
    config = make_run(tmp_path)
    sigterm_after(monkeypatch, "train_tokenizer")
    assert run(config) == STOPPED_EXIT_CODE == 75
    err = capsys.readouterr().err
    assert "stopped on SIGTERM after the tokenizer stage; run the same command again" in err, err
    assert "Traceback" not in err
    out = tmp_path / "out" / "tiny"
    assert json.loads((out / "tokenizer/run_info.json").read_text())["result"]["finished"]
    assert not (out / "basemodel").exists()  # the predictor stage never started
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and GracefulStop.active is None
    monkeypatch.undo()
    assert run(config) == 0
    assert outputs(tmp_path) == uninterrupted


@pytest.mark.slow
def test_sigterm_while_calibrating_stops_and_the_rerun_calibrates(tmp_path, uninterrupted, monkeypatch, capsys,
                                                                  one_thread):
    config = make_run(tmp_path)
    sample = pipeline.sample_paths  # the calibration's sampling (the first batch's safe point comes next)

    def signal_then_sample(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return sample(*args, **kwargs)

    monkeypatch.setattr(pipeline, "sample_paths", signal_then_sample)
    assert run(config) == STOPPED_EXIT_CODE
    assert "stopped on SIGTERM while sampling forecasts; run the same command again" in capsys.readouterr().err
    info = tmp_path / "out/tiny/basemodel/best_model/kronos_predictor.json"
    assert "calibration" not in json.loads(info.read_text())
    monkeypatch.undo()
    assert run(config, "--skip-existing") == 0  # the predictor is finished: skipped, but calibrated
    assert outputs(tmp_path) == uninterrupted


KILLED_BEFORE_CALIBRATION = textwrap.dedent("""
    import os, sys
    import finetune_csv.pipeline as pipeline
    from finetune_csv import train_sequential
    pipeline.calibrate = lambda *args, **kwargs: os._exit(137)   # killed once the predictor finished
    train_sequential.main(["--config", sys.argv[1]])
""")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--skip-existing"], ["--resume"]], ids=["rerun", "skip-existing", "resume"])
def test_a_kill_between_the_finished_predictor_and_its_calibration_is_calibrated_by_the_next_run(
        tmp_path, uninterrupted, flags, one_thread):
    config = make_run(tmp_path)
    killed = subprocess.run([sys.executable, "-c", KILLED_BEFORE_CALIBRATION, str(config)], capture_output=True,
                            text=True, env={**env_one_thread(), "PYTHONPATH": str(REPO)}, timeout=600)
    assert killed.returncode == 137, killed.stderr[-3000:]
    info = json.loads((tmp_path / "out/tiny/basemodel/best_model/kronos_predictor.json").read_text())
    assert json.loads((tmp_path / "out/tiny/basemodel/run_info.json").read_text())["result"]["finished"]
    assert "calibration" not in info
    assert run(config, *flags) == 0
    assert outputs(tmp_path) == uninterrupted


@pytest.mark.slow
def test_sigterm_while_kronos_forecast_samples_stops_with_75_and_writes_nothing(tmp_path, monkeypatch, capsys,
                                                                               one_thread):
    from finetune_csv import forecast

    config = make_run(tmp_path)
    assert run(config) == 0
    sample = forecast.sample_paths

    def signal_then_sample(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return sample(*args, **kwargs)

    monkeypatch.setattr(forecast, "sample_paths", signal_then_sample)
    assert run_main(forecast.main, ["--config", str(config)]) == STOPPED_EXIT_CODE
    assert "stopped on SIGTERM while sampling forecasts; run the same command again" in capsys.readouterr().err
    assert not (tmp_path / "out/tiny/forecast/metrics.json").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and GracefulStop.active is None
    monkeypatch.undo()
    assert run_main(forecast.main, ["--config", str(config)]) == 0
    assert (tmp_path / "out/tiny/forecast/metrics.json").is_file()
