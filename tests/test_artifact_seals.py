"""Issue 44 (artifacts, outputs, limits): every artifact sealed where it is written and checked where it is read (a
damaged best model or calibration refused by name, a damaged checkpoint skipped, an edited windows.csv caught by
content), forecast folders written whole under a lock and saying what made them, absurd settings refused up front."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from finetune.utils import checkpoint as store
from finetune.utils.errors import classify, run_main
from finetune.utils.safety import GracefulStop, RunLock, TrainingStopped
from finetune_csv import forecast
from finetune_csv.config import load
from finetune_csv.splits import min_rows_needed
from model.calibration import write_calibration
from model.errors import EXIT_CONFIG, EXIT_DATA, EXIT_PATH, EXIT_REFUSED, DataError, PathError
from model.fileio import check_seal, seal
from model.predictor import PREDICTOR_INFO_NAME, load_trained_pair, predictor_info
from tests.model_factory import tiny_models
from tests.test_csv_eval import make_run as make_eval_run


def _pair(folder: Path) -> Path:
    """A sealed predictor folder as finetune writes one: weights, its tokenizer copy, kronos_predictor.json."""
    tok, pred = tiny_models(seed=0)
    pred.save_pretrained(folder)
    tok.save_pretrained(folder / "tokenizer")
    from model.hub import weights_fingerprint

    info = predictor_info(folder, max_context=64, lookback=24, clip=5.0, tokenizer=folder / "tokenizer",
                          tokenizer_sha256=weights_fingerprint(tok))
    (folder / "kronos_predictor.json").write_text(json.dumps(info))
    seal(folder)
    return folder


def test_a_doubled_weight_in_a_valid_safetensors_file_is_refused_by_name(tmp_path):
    folder = _pair(tmp_path / "best_model")
    load_trained_pair(folder)  # intact: loads
    weights = load_file(folder / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] * 2  # still a valid file, still finite: only the seal tells
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(DataError, match=r"model\.safetensors is not the file written there"):
        load_trained_pair(folder)


def test_a_calibration_edited_within_range_and_a_changed_tokenizer_pointer_are_refused(tmp_path):
    folder = _pair(tmp_path / "best_model")
    margins = [[0.01, 0.02], [0.03, 0.04]]
    write_calibration(folder / PREDICTOR_INFO_NAME, {"method": "conformal", "space": "band", "levels": [0.5, 0.8],
                                                      "margins": margins, "windows": 9})
    assert load_trained_pair(folder)[2]["calibration"]["margins"] == margins  # re-sealed by write_calibration
    info_path = folder / "kronos_predictor.json"
    good = info_path.read_text()
    info_path.write_text(good.replace("0.03", "0.05"))  # still a valid calibration
    with pytest.raises(DataError, match=r"kronos_predictor\.json is not the file written there"):
        load_trained_pair(folder)
    info = json.loads(good)
    del info["tokenizer_sha256"]
    info["tokenizer"] = str(tmp_path / "elsewhere")
    info_path.write_text(json.dumps(info))
    with pytest.raises(DataError, match=r"kronos_predictor\.json is not the file written there"):
        load_trained_pair(folder)
    info_path.write_text(good)
    (folder / "tokenizer" / "model.safetensors").unlink()
    with pytest.raises(DataError, match=r"tokenizer/model\.safetensors is missing"):
        check_seal(folder)


def test_a_flipped_bit_in_the_newest_checkpoint_falls_back_to_the_previous_one_saying_so(tmp_path):
    for step in (1, 2):
        store.save({"format": store.CHECKPOINT_FORMAT, "model": {"w": torch.full((256, 256), float(step))}},
                   tmp_path, step)
    newest = tmp_path / "step-00000002.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor's bytes: torch.load alone would load it silently
    newest.write_bytes(bytes(data))
    torch.load(newest, weights_only=True)  # the premise: torch does not notice
    said = []
    path, state = store.load_latest(tmp_path, validate=store.check_format, log=said.append)
    assert path.name == "step-00000001.pt" and float(state["model"]["w"][0, 0]) == 1.0
    assert "step-00000002.pt is unusable" in said[0] and "CRC-32" in said[0] and "step-00000001.pt" in said[0]



def test_a_second_forecast_into_a_locked_folder_is_refused_and_writes_nothing(tmp_path, capsys):
    config = make_eval_run(tmp_path)
    base = tmp_path / "out" / "ev"
    with RunLock(base, name=".future.lock", key="paths.base_dir"):  # another forecast is writing future/
        assert run_main(forecast.main, ["--config", str(config), "--future"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "another run is already writing" in err and "pid" in err and "Traceback" not in err
    assert not (base / "future").exists()


@pytest.mark.slow
def test_a_future_forecast_is_written_whole_and_a_kill_mid_write_keeps_the_previous_set(tmp_path, monkeypatch):
    config = make_eval_run(tmp_path, zero_shot=None)
    future = tmp_path / "out" / "ev" / "future"
    assert run_main(forecast.main, ["--config", str(config), "--future"]) == 0
    check_seal(future)
    made = json.loads((future / "forecast.json").read_text())
    assert made["model"]["predictor_sha256"] and len(made["data"]["files"]) == 2 and made["settings"]["data"]
    before = {p.name: p.read_bytes() for p in future.iterdir()}

    def killed(*args, **kwargs):  # dies after forecast.csv and forecast.json are written, before the plot
        raise KeyboardInterrupt

    monkeypatch.setattr(forecast, "plot_panels", killed)
    assert run_main(forecast.main, ["--config", str(config), "--future", "--set", "forecast.seed=5"]) == 130
    assert {p.name: p.read_bytes() for p in future.iterdir()} == before  # the previous complete set
    monkeypatch.undo()
    (future.parent / ".future.k1ll3d.tmp").mkdir()  # what a SIGKILL mid-build leaves beside the folder
    (future.parent / ".future.k1ll3d.tmp" / "forecast.csv").write_text("half")
    # The data changes (cut by 6 bars here): future/, the stable path, holds the new forecast; forecast.json says so.
    for csv in (tmp_path / "data").glob("*.csv"):
        frame = pd.read_csv(csv)
        frame.iloc[:-6].to_csv(csv, index=False)
    assert run_main(forecast.main, ["--config", str(config), "--future"]) == 0
    assert not list(future.parent.glob(".future.*.tmp"))  # the killed forecast's leftovers are gone
    check_seal(future)
    again = json.loads((future / "forecast.json").read_text())
    assert again["data"]["files"] != made["data"]["files"]
    assert (future / "forecast.csv").read_bytes() != before["forecast.csv"]


@pytest.mark.slow
def test_a_forecast_on_other_split_ratios_writes_beside_the_run_and_says_what_differs(tmp_path, caplog):
    config = make_eval_run(tmp_path, zero_shot=None)
    cfg = load(config)
    from finetune.utils.config_utils import config_to_dict

    (cfg.predictor_dir / "run_info.json").write_text(json.dumps({"config": config_to_dict(cfg)}))
    assert run_main(forecast.main, ["--config", str(config)]) == 0
    own = cfg.base_dir / "forecast"
    kept = {p.name: p.read_bytes() for p in own.iterdir()}
    assert json.loads((own / "forecast.json").read_text())["differs_from_run"] == []
    args = ["--set", "data.train_ratio=0.5", "--set", "data.val_ratio=0.3"]
    assert run_main(forecast.main, ["--config", str(config), *args]) == 0
    assert {p.name: p.read_bytes() for p in own.iterdir()} == kept  # the run's own outputs untouched
    (beside,) = [p for p in cfg.base_dir.iterdir() if p.name.startswith("forecast_")]
    differs = json.loads((beside / "forecast.json").read_text())["differs_from_run"]
    assert differs == ["data.train_ratio: 0.6 -> 0.5", "data.val_ratio: 0.2 -> 0.3"]
    assert "data.train_ratio: 0.6 -> 0.5" in caplog.text and "beside the run's own outputs" in caplog.text
    # Another column mapping: the run's data store is never re-prepared in place; its own store goes beside it.
    store = {p: p.read_bytes() for p in cfg.store_dir.rglob("*") if p.is_file()}
    assert run_main(forecast.main, ["--config", str(config), "--set", "data.columns.amount=null"]) == 0
    assert {p: p.read_bytes() for p in store} == store and {p.name: p.read_bytes() for p in own.iterdir()} == kept
    (other,) = [p for p in cfg.base_dir.iterdir() if p.name.startswith("data_store_")]
    (made,) = [json.loads((p / "forecast.json").read_text()) for p in cfg.base_dir.iterdir()
               if p.name.startswith("forecast_") and p != beside]
    assert made["differs_from_run"] == ["data.columns.amount: 'amount' -> None"]
    assert made["data"]["store"] == str(other)


@pytest.mark.parametrize("setting, message", [
    ("training.seed=-5", "training.seed: must be a seed in [0, 2**32 - 1], got -5"),
    ("predictor_training.lr=inf", "predictor_training.lr: must be a finite number, got inf"),
    ("training.weight_decay=.nan", "training.weight_decay: must be a finite number, got nan"),
    ("data.lookback=1000000000000", "data.lookback: must be <= 1_000_000 (no real run needs more), got 1000000000000"),
])
def test_absurd_settings_are_one_line_config_errors(tmp_path, capsys, setting, message):
    config = make_eval_run(tmp_path)
    assert run_main(forecast.main, ["--config", str(config), "--set", setting]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_sample_count_that_cannot_fit_in_memory_is_refused_before_sampling(tmp_path, capsys, monkeypatch):
    config = make_eval_run(tmp_path)
    monkeypatch.setattr(forecast, "sample_paths", lambda *a, **k: pytest.fail("sampled"))
    assert run_main(forecast.main, ["--config", str(config), "--future", "--set",
                                    "forecast.sample_count=1000000000"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "forecast.sample_count: 1000000000 sample paths" in err and "GiB" in err


def test_the_shortest_usable_series_is_found_without_stepping_one_row_at_a_time(tmp_path):
    cfg = load(make_eval_run(tmp_path), ["data.lookback=1000000"])
    t0 = time.monotonic()
    n = min_rows_needed(cfg.data)
    assert time.monotonic() - t0 < 1.0
    assert int(n * 0.6) >= 1_000_006 and int((n - 1) * 0.6) < 1_000_006  # the smallest, as the linear search found


def test_a_read_only_output_filesystem_is_a_one_line_path_error(tmp_path, monkeypatch):
    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(PathError, match=r"paths.base_dir: cannot write into .*Read-only file system.*writable"):
        RunLock(tmp_path / "new", key="paths.base_dir").acquire()
    assert classify(OSError(errno.EROFS, "Read-only file system", "/x")) == (EXIT_PATH, True)


def test_the_qlib_walk_forward_passes_a_sigterm_to_the_period_trainer_and_stops(tmp_path, monkeypatch):
    from finetune import qlib_walk_forward as qwf

    trainer = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); "
               "open(sys.argv[1], 'w').close(); time.sleep(30)")
    started = tmp_path / "started"
    popen = subprocess.Popen
    monkeypatch.setattr(qwf, "check_processed", lambda *a: None)
    monkeypatch.setattr(qwf, "dump_config", lambda c: "")
    monkeypatch.setattr(qwf.subprocess, "Popen", lambda cmd, **kw: popen([sys.executable, "-c", trainer,
                                                                          str(started)], **kw))

    def sigterm_once_started():
        while not started.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    (tmp_path / "period_0").mkdir()
    threading.Thread(target=sigterm_once_started, daemon=True).start()
    t0 = time.monotonic()
    with GracefulStop(), pytest.raises(TrainingStopped, match="stopped on SIGTERM while training period_0"):
        qwf.train_period(None, tmp_path / "period_0", 1)
    assert time.monotonic() - t0 < 20  # the trainer got the signal; not its 30 s sleep


@pytest.mark.slow
def test_a_finished_run_with_a_doubled_best_model_weight_is_refused_by_finetune_and_forecast(tmp_path, capsys,
                                                                                            one_thread):
    from tests.test_csv_train import make_run
    from tests.test_safety_stage_boundaries import run

    config = make_run(tmp_path)
    assert run(config) == 0
    best = tmp_path / "out" / "tiny" / "basemodel" / "best_model"
    weights = load_file(best / "model.safetensors")
    name = next(iter(weights))
    save_file({**weights, name: weights[name] * 2}, best / "model.safetensors")
    capsys.readouterr()
    assert run(config) == EXIT_DATA  # would skip the finished stage: refuses instead, naming the file
    assert run_main(forecast.main, ["--config", str(config)]) == EXIT_DATA
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    named = f"{best / 'model.safetensors'} is not the file written there"
    assert "Traceback" not in "".join(err) and len(err) == 2 and all(named in e for e in err)


def test_a_forecast_refuses_a_zero_shot_start_that_is_not_the_one_the_run_was_finetuned_from(tmp_path, capsys):
    """Audit of issue 44 cause 1: model.pretrained_predictor overwritten in place after finetuning; the forecast
    would score the new weights as "zero-shot" against a model finetuned from the old ones."""
    from model.hub import weights_fingerprint
    from tests.model_factory import tiny_predictor

    config = make_eval_run(tmp_path, zero_shot="same")  # start/predictor: tiny_predictor(seed=7)
    cfg = load(config)
    (cfg.predictor_dir / "run_info.json").write_text(json.dumps({"start_fingerprint":
                                                                 weights_fingerprint(tiny_predictor(seed=7))}))
    assert run_main(forecast.main, ["--config", str(config)]) == 0  # the start it recorded: compared
    shutil.rmtree(cfg.base_dir / "forecast")
    tiny_predictor(seed=8).save_pretrained(tmp_path / "start" / "predictor")  # overwritten in place
    assert run_main(forecast.main, ["--config", str(config)]) == EXIT_DATA
    err = capsys.readouterr().err
    assert "model.pretrained_predictor: its weights are not the ones the run" in err and "Traceback" not in err
    assert not (cfg.base_dir / "forecast").exists()


def test_a_folder_named_like_a_data_file_in_the_data_folder_is_named_not_skipped(tmp_path):
    """Audit of issue 44 cause 7: a sub-folder `x.csv/` (as Spark writes one) was dropped without a word."""
    from finetune.utils.errors import StoreError
    from finetune_csv.sources import list_sources

    (tmp_path / "a.csv").write_text("timestamps,open\n")
    (tmp_path / "archive").mkdir()  # any other folder: not an input, ignored as before
    assert list_sources(tmp_path) == [tmp_path / "a.csv"]
    (tmp_path / "b.csv").mkdir()
    (tmp_path / "b.csv" / "part-0000.csv").write_text("timestamps,open\n")
    with pytest.raises(StoreError, match=r"not readable regular files .*a folder named like a data file.*\['b\.csv'\]"):
        list_sources(tmp_path)
