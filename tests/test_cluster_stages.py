"""A finished predictor is reused only with the tokenizer it was trained with (a changed
tokenizer is named and the run refuses to pair them silently); `--resume` after a kill in the tokenizer stage
finishes both stages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from finetune.utils.checkpoint import load_latest
from finetune.utils.errors import run_main
from finetune.utils.ledger import stage_status
from finetune.utils.stages import stage_resume
from finetune_csv import train_sequential
from finetune_csv.config import load
from finetune_csv.pipeline import CsvPipeline
from model import KronosTokenizer
from model.hub import weights_fingerprint
from tests.model_factory import tiny_tokenizer
from tests.test_csv_train import REPO, SCRIPT, make_run


def run(config, *extra: str) -> int:
    return run_main(train_sequential.main, ["--config", str(config), *extra])


def test_a_finished_predictor_is_not_paired_with_a_changed_tokenizer(tmp_path, capsys, one_thread):
    config = make_run(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path / "pretrained_tok")
    common = ["--set", f"model.pretrained_tokenizer={tmp_path / 'pretrained_tok'}"]
    assert run(config, *common, "--set", "tokenizer_training.epochs=0") == 0  # predictor on the pretrained one
    out = tmp_path / "out" / "tiny"
    weights = (out / "basemodel" / "best_model" / "model.safetensors").read_bytes()
    capsys.readouterr()

    # The same folder, now with a trained tokenizer: the finished predictor no longer matches it.
    assert run(config, *common, "--set", "tokenizer_training.epochs=1") == 5
    err = capsys.readouterr().err
    assert "holds a finished run, but the frozen tokenizer's weights changed" in err, err
    assert "--overwrite" in err and "Traceback" not in err
    assert (out / "basemodel" / "best_model" / "model.safetensors").read_bytes() == weights  # kept, not replaced

    # --overwrite retrains it on the new tokenizer; the pairing is recorded in the checkpoint and run_info.json.
    assert run(config, *common, "--set", "tokenizer_training.epochs=1", "--overwrite") == 0
    new_tok = weights_fingerprint(KronosTokenizer.from_pretrained(out / "tokenizer" / "best_model"))
    _, saved = load_latest(out / "basemodel" / "checkpoints")
    assert saved["frozen_fingerprint"] == new_tok
    assert json.loads((out / "basemodel" / "run_info.json").read_text())["frozen_fingerprint"] == new_tok

    # Unchanged now: the finished stages are skipped again.
    assert run(config, *common, "--set", "tokenizer_training.epochs=1") == 0
    assert "already holds a finished run; skipping it" in capsys.readouterr().err


def test_accept_changed_data_keeps_the_finished_predictor_with_a_warning(tmp_path, capsys, one_thread):
    config = make_run(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path / "pretrained_tok")
    common = ["--set", f"model.pretrained_tokenizer={tmp_path / 'pretrained_tok'}"]
    assert run(config, *common, "--set", "tokenizer_training.epochs=0") == 0
    capsys.readouterr()
    assert run(config, *common, "--set", "tokenizer_training.epochs=1", "--set",
               "training.accept_changed_data=true") == 0
    assert "keeping the finished run although the frozen tokenizer's weights changed" in capsys.readouterr().err


def test_resume_with_nothing_anywhere_to_resume_is_still_an_error(tmp_path):
    cfg = load(make_run(tmp_path), ["training.resume=required"])
    plan = {"tokenizer": None, "predictor": None}
    assert stage_resume(CsvPipeline(cfg), plan) == {"tokenizer": "required", "predictor": "required"}
    (cfg.tokenizer_dir / "checkpoints").mkdir(parents=True)
    (cfg.tokenizer_dir / "checkpoints" / "step-00000001.pt").write_bytes(b"x")
    assert stage_resume(CsvPipeline(cfg), plan) == {"tokenizer": "required", "predictor": "auto"}


@pytest.mark.slow  # two CSV runs in subprocesses, about 50 s per flag set
@pytest.mark.parametrize("flags", [["--resume"], ["--skip-existing", "--resume"]])
def test_resume_after_a_kill_in_the_tokenizer_stage_finishes_both_stages(tmp_path, flags):
    config = make_run(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--config", str(config), "--set", "training.save_every_steps=1"]
    killed = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={**env, "KRONOS_FAULT_EXIT_AFTER_STEP": "2"})
    assert killed.returncode == 17, killed.stderr[-2000:]
    out = tmp_path / "out" / "tiny"
    assert stage_status(out / "tokenizer") == "unfinished" and stage_status(out / "basemodel") == "empty"
    resumed = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr
    assert stage_status(out / "tokenizer") == "finished" and stage_status(out / "basemodel") == "finished"
