"""Every configs/csv_*.yaml loads into the CSV pipeline's dataclasses and passes validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune_csv.config import CsvFinetuneConfig, load

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("csv_*.yaml"))


def test_there_are_csv_configs():
    assert len(CONFIGS) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads_and_validates(path):
    cfg = load(path)
    assert isinstance(cfg, CsvFinetuneConfig)
    assert "{" not in str(cfg.base_dir)  # templates resolved
    assert cfg.data.lookback + cfg.data.predict > 1
    assert cfg.tokenizer_dir.parent == cfg.predictor_dir.parent == cfg.base_dir


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_holds_out_a_test_split_for_the_readme_forecast_step(path):
    assert load(path).data.test_ratio > 0  # finetune_csv/forecast.py forecasts the test split
