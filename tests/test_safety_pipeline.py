"""Run safety at the pipeline level: --skip-existing skips only FINISHED stages, and the
predictor stage never trains on (or forecasts with) a half-trained tokenizer."""

from __future__ import annotations

import json

import pytest

import finetune_csv.config as csv_config
from finetune.utils.schema import STAGES
from finetune.utils.stages import plan_stages
from finetune_csv.pipeline import CsvPipeline
from tests.model_factory import tiny_tokenizer


@pytest.fixture
def cfg(tmp_path):
    return csv_config.load("configs/csv_scratch_tiny.yaml", [f"paths.base_dir={tmp_path / 'run'}",
                                                             "data.path=unused.csv"])


def interrupted_tokenizer_stage(cfg):
    """What an interrupted tokenizer stage leaves: best_model/ of epoch 1, a checkpoint, no finished record."""
    folder = cfg.tokenizer_dir
    tiny_tokenizer().save_pretrained(folder / "best_model")
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.pt").write_bytes(b"")
    (folder / "run_info.json").write_text(json.dumps({"result": {"finished": False}}))
    return folder


def test_skip_existing_does_not_skip_an_interrupted_stage(cfg):
    interrupted_tokenizer_stage(cfg)
    assert plan_stages(CsvPipeline(cfg), STAGES, {}, skip_existing=True)["tokenizer"] is None  # it trains (resumes)


def test_skip_existing_skips_a_finished_stage(cfg):
    folder = interrupted_tokenizer_stage(cfg)
    (folder / "run_info.json").write_text(json.dumps({"result": {"finished": True}}))
    assert "finished" in plan_stages(CsvPipeline(cfg), STAGES, {}, skip_existing=True)["tokenizer"]


def test_predictor_refuses_a_half_trained_tokenizer(cfg):
    interrupted_tokenizer_stage(cfg)
    with pytest.raises(ValueError, match="tokenizer stage in .* is unfinished"):
        CsvPipeline(cfg).tokenizer_source()


def test_a_model_placed_by_hand_is_used(cfg):
    tiny_tokenizer().save_pretrained(cfg.tokenizer_dir / "best_model")  # no run records: the user's own model
    assert CsvPipeline(cfg).tokenizer_source() == (str(cfg.tokenizer_dir / "best_model"), "paths.base_dir")
