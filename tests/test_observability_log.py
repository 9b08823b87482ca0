"""train.log per stage: rank 0 only, appended across runs with a header per run, no duplicate or crossed lines."""

from __future__ import annotations

import logging
import sys

import pytest

from finetune.utils.errors import setup_logging, stage_log

log = logging.getLogger("finetune.utils.training_utils")




def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_two_stages_in_one_process_each_get_their_own_lines(tmp_path, restore_root_logger, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train_sequential.py", "--config", "my config.yaml"])
    setup_logging(rank=0)
    tok, pred = tmp_path / "tokenizer" / "train.log", tmp_path / "predictor" / "train.log"
    with stage_log(tok, rank=0, stage="tokenizer"):
        log.info("tokenizer epoch 1")
    log.info("between stages")
    with stage_log(pred, rank=0, stage="predictor"):
        log.info("predictor epoch 1")
        log.warning("predictor warning")

    t, p = _lines(tok), _lines(pred)
    assert len(t) == 2 and len(p) == 3
    assert t[0].startswith("===== ") and "tokenizer run (fresh start)" in t[0]
    assert "command: train_sequential.py --config 'my config.yaml'" in t[0]
    assert t[1].endswith("INFO tokenizer epoch 1")
    assert p[1].endswith("INFO predictor epoch 1") and p[2].endswith("WARNING predictor warning")
    assert not any("between stages" in line for line in t + p)
    assert _open_logs(tmp_path) == []


def _open_logs(folder):
    """File handlers on the root logger writing under `folder` (pytest attaches its own elsewhere)."""
    return [h for h in logging.getLogger().handlers
            if isinstance(h, logging.FileHandler) and str(folder) in h.baseFilename]


def test_resume_appends_with_a_header_and_a_second_handler_for_the_same_file_is_not_added(
        tmp_path, restore_root_logger):
    path = tmp_path / "train.log"
    with stage_log(path, rank=0):
        log.info("first run")
    with stage_log(path, rank=0, resumed_from=tmp_path / "checkpoints" / "last.pt"):
        with stage_log(path, rank=0) as again:
            assert again is None  # same file already attached: no doubled lines
        log.info("second run")

    lines = _lines(path)
    assert len(lines) == 4
    assert "(fresh start)" in lines[0] and lines[1].endswith("first run")
    assert f"(resumed from {tmp_path / 'checkpoints' / 'last.pt'})" in lines[2]
    assert lines[3].endswith("second run")


def test_other_ranks_write_no_file_and_the_root_level_is_restored(tmp_path, restore_root_logger):
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    with stage_log(tmp_path / "r1" / "train.log", rank=1) as handler:
        log.info("rank 1 progress")
    assert handler is None and not (tmp_path / "r1").exists()

    with stage_log(tmp_path / "r0" / "train.log", rank=0):
        assert root.level == logging.INFO  # INFO progress lines reach the file even if the root was at WARNING
        log.info("rank 0 progress")
    assert root.level == logging.WARNING
    assert _lines(tmp_path / "r0" / "train.log")[1].endswith("INFO rank 0 progress")


def test_the_file_is_closed_when_the_stage_fails(tmp_path, restore_root_logger):
    with pytest.raises(RuntimeError), stage_log(tmp_path / "train.log", rank=0):
        log.error("loss is NaN")
        raise RuntimeError("boom")
    assert _open_logs(tmp_path) == []
    assert _lines(tmp_path / "train.log")[1].endswith("ERROR loss is NaN")
