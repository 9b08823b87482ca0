"""Every configs/qlib_*.yaml loads into the Qlib pipeline's dataclasses and passes validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.config import QlibConfig, load

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("qlib_*.yaml"))


def test_there_are_qlib_configs():
    assert {p.name for p in CONFIGS} >= {"qlib_demo.yaml", "qlib_csi300.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads_and_validates(path):
    cfg = load(str(path))  # validates
    assert isinstance(cfg, QlibConfig)
    assert all("{" not in v for v in vars(cfg.paths).values())  # templates resolved
    assert cfg.paths.finetuned_tokenizer_path.startswith(cfg.paths.tokenizer_dir)
    assert all(isinstance(x, str) for x in cfg.data.train_time_range)  # YAML dates kept as ISO strings


def test_csi300_config_keeps_the_original_settings():
    cfg = load(str(CONFIGS[0].parent / "qlib_csi300.yaml"))
    d, b = cfg.data, cfg.backtest
    assert (d.instrument, d.lookback, d.predict, d.clip) == ("csi300", 90, 10, 5.0)
    assert (cfg.stage_training("tokenizer").lr, cfg.stage_training("predictor").lr) == (2e-4, 4e-5)
    t = cfg.training
    assert (t.batch_size, t.max_train_samples, t.max_val_samples, t.epochs, t.seed) == (50, 100_000, 20_000, 30, 100)
    assert (cfg.benchmark, b.topk, b.n_drop, b.hold_thresh) == ("SH000300", 50, 5, 5)
    assert (b.open_cost, b.close_cost, b.min_cost, b.limit_threshold) == (0.001, 0.0015, 5.0, 0.095)
    f = cfg.forecast
    assert (f.temperature, f.top_p, f.top_k, f.sample_count, f.batch_size) == (0.6, 0.9, 0, 5, 1000)
    assert cfg.model.pretrained_predictor == "NeoQuasar/Kronos-small"
    assert cfg.model.pretrained_tokenizer == "NeoQuasar/Kronos-Tokenizer-base"


def test_demo_config_starts_from_the_local_pretrained_pair_offline():
    cfg = load(str(CONFIGS[0].parent / "qlib_demo.yaml"))
    for path in (cfg.model.pretrained_tokenizer, cfg.model.pretrained_predictor):
        assert (CONFIGS[0].parent.parent / path / "config.json").is_file()  # local: nothing is downloaded
    assert cfg.forecast.seed_list() == [0, 1, 2]
