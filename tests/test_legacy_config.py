"""finetune_csv/original_config.py: a YAML written for the original Kronos finetune_csv loads into this project's
settings, key by key, with a log line per key and a warning per value that cannot be honoured."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import yaml

import finetune_csv.config as csv_config
from finetune import cli
from finetune.utils.config_utils import config_to_dict
from finetune_csv.config import CsvFinetuneConfig
from finetune_csv.original_config import ORIGINAL_DEFAULTS, RULES, is_original_config, translate
from model.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ORIGINAL = ROOT / "configs/original/finetune_csv.yaml"  # a subfolder: configs/*.yaml are csv_*/qlib_* files


def _raw() -> dict:
    return yaml.safe_load(ORIGINAL.read_text())


def _write(tmp_path: Path, raw: dict, name: str = "orig.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def _leaf_keys(obj, prefix=""):
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        yield from (_leaf_keys(value, key) if dataclasses.is_dataclass(value) else [key])


def test_detection():
    assert is_original_config(_raw())
    for path in sorted((ROOT / "configs").glob("csv_*.yaml")):
        assert not is_original_config(yaml.safe_load(path.read_text())), path
    assert is_original_config({"data": {"data_path": "x.csv", "lookback_window": 90}})  # original-only keys
    assert not is_original_config({"data": {"path": "x.csv", "clip": 5.0}})
    assert not is_original_config(["not", "a", "mapping"])


def test_rules_name_real_keys_of_this_project():
    ours = set(_leaf_keys(CsvFinetuneConfig()))
    for old, rule in RULES.items():
        if rule.new is not None and "*" not in rule.new:
            assert rule.new in ours, f"{old} -> {rule.new}"
    assert set(ORIGINAL_DEFAULTS) <= ours


def test_shipped_original_config_loads_with_the_same_meaning(caplog):
    with caplog.at_level(logging.INFO, logger="finetune_csv.original_config"):
        cfg = csv_config.load(ORIGINAL, ["training.seed=9"])
    assert isinstance(cfg, CsvFinetuneConfig)
    d, t = cfg.data, cfg.training
    assert (d.path, d.lookback, d.predict, d.clip) == ("data/generated/csv_demo_5min/SH600000.csv", 256, 32, 5.0)
    assert (d.train_ratio, d.val_ratio, d.test_ratio) == (0.8, 0.15, 0.05)
    assert (cfg.tokenizer_training.epochs, cfg.predictor_training.epochs) == (10, 5)
    assert (cfg.tokenizer_training.lr, cfg.predictor_training.lr) == (1e-4, 2e-5)
    assert tuple(t.betas) == (0.9, 0.98) and t.weight_decay == 0.05 and t.accumulation_steps == 2
    assert (t.batch_size, t.log_every_steps, t.num_workers, t.seed, t.comet) == (64, 20, 2, 9, False)
    assert cfg.model.pretrained_tokenizer == "NeoQuasar/Kronos-Tokenizer-base"
    assert cfg.model.pretrained_predictor == "NeoQuasar/Kronos-small"
    assert cfg.paths.exp_name == "original_format_example"
    assert cfg.paths.base_dir == "outputs/original_format_example"
    assert cfg.tokenizer_dir == Path("outputs/original_format_example/tokenizer")
    text = caplog.text
    assert "data.lookback_window -> data.lookback = 256" in text
    assert "training.basemodel_epochs -> predictor_training.epochs = 5" in text
    assert "model_paths.pretrained_tokenizer -> model.pretrained_tokenizer" in text
    # one line for every key of the file, and nothing unsupported in the shipped example
    for key in _flat(_raw()):
        assert f"  {key} " in text, key
    assert "not supported" not in text


def _flat(raw, prefix=""):
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else k
        yield from (_flat(v, key) if isinstance(v, dict) else [key])


def test_unsupported_and_unknown_keys_are_named(tmp_path, caplog):
    raw = _raw()
    raw["device"]["device_id"] = 2
    raw["model_paths"]["tokenizer_save_name"] = "tok"
    raw["experiment"]["skip_existing"] = True
    raw["training"]["warmup"] = 0.1
    with caplog.at_level(logging.WARNING, logger="finetune_csv.original_config"):
        csv_config.load(_write(tmp_path, raw))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("device.device_id = 2: not supported" in m and "CUDA_VISIBLE_DEVICES" in m for m in warned)
    assert any("model_paths.tokenizer_save_name = \"tok\": not supported" in m for m in warned)
    assert any("experiment.skip_existing = true: not supported" in m and "--skip-existing" in m for m in warned)
    assert any("training.warmup: not a key of the original" in m for m in warned)


def test_stage_switches_and_shared_epochs():
    raw = {"data": {"data_path": "x.csv"}, "training": {"epochs": 4, "tokenizer_epochs": 2},
           "experiment": {"train_basemodel": False}}
    values = translate(raw).values
    assert values["training"]["epochs"] == 4
    assert values["tokenizer_training"]["epochs"] == 2
    assert values["predictor_training"]["epochs"] == 0  # train_basemodel: false = stage skipped


def test_original_defaults_fill_what_the_file_leaves_out():
    result = translate({"data": {"data_path": "x.csv"}})
    assert result.values["training"]["batch_size"] == ORIGINAL_DEFAULTS["training.batch_size"] == 160
    assert any("training.batch_size (absent) -> training.batch_size = 160" in line for line in result.lines)
    assert translate({"training": {"batch_size": 8}}).values["training"]["batch_size"] == 8


def test_base_paths():
    with_base = translate({"model_paths": {"exp_name": "e", "base_path": "/runs/", "base_save_path": ""}}).values
    assert with_base["paths"] == {"exp_name": "e", "base_dir": "/runs/{exp_name}"}
    explicit = translate({"model_paths": {"exp_name": "e", "base_path": "/runs", "base_save_path": "/x/{exp_name}"}})
    assert explicit.values["paths"]["base_dir"] == "/x/{exp_name}"
    same = translate({"model_paths": {"exp_name": "e", "base_path": "/runs",
                                      "finetuned_tokenizer": "/runs/e/tokenizer/best_model"}})
    assert not same.unsupported
    other = translate({"model_paths": {"exp_name": "e", "base_path": "/runs", "finetuned_tokenizer": "/else/tok"}})
    assert other.unsupported and other.unsupported[0].startswith("model_paths.finetuned_tokenizer")


def test_not_pretrained_takes_the_architecture_from_the_pretrained_folder(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"d_in": 6, "d_model": 64, "n_heads": 2, "s1_bits": 8,
                                                    "s2_bits": 8}))
    raw = {"model_paths": {"pretrained_tokenizer": str(folder), "pretrained_predictor": "NeoQuasar/Kronos-small"},
           "experiment": {"pre_trained": False, "pre_trained_predictor": True}}
    result = translate(raw)
    model = result.values["model"]
    assert model["pretrained_tokenizer"] is None
    assert model["tokenizer_arch"] == {"d_in": 6, "d_model": 64, "n_heads": 2, "s1_bits": 8, "s2_bits": 8}
    assert model["pretrained_predictor"] == "NeoQuasar/Kronos-small"  # pre_trained_predictor overrides pre_trained
    hub = translate({"model_paths": {"pretrained_predictor": "NeoQuasar/Kronos-small"},
                     "experiment": {"pre_trained_predictor": False}})
    assert hub.unsupported and "model.predictor_arch" in hub.unsupported[0]


def test_overrides_with_original_and_new_keys(tmp_path):
    cfg = csv_config.load(ORIGINAL, ["data.lookback_window=128", "data.stride=4", "training.tokenizer_epochs=1"])
    assert (cfg.data.lookback, cfg.data.stride, cfg.tokenizer_training.epochs) == (128, 4, 1)


def test_problems_are_reported_with_the_new_keys_and_the_original_file(tmp_path):
    raw = _raw()
    raw["data"]["lookback_window"] = 0
    path = _write(tmp_path, raw)
    with pytest.raises(ConfigError) as err:
        csv_config.load(path)
    assert str(path) in str(err.value).splitlines()[0] and "original Kronos format" in str(err.value)
    assert any(p.startswith("data.lookback: must be >= 2") for p in err.value.problems)


def test_original_keys_mixed_into_the_new_format_are_named(tmp_path):
    raw = yaml.safe_load((ROOT / "configs/csv_demo.yaml").read_text())
    raw["data"]["lookback_window"] = 64
    with pytest.raises(ConfigError) as err:
        csv_config.load(_write(tmp_path, raw, "mixed.yaml"))
    assert err.value.problems == ["data.lookback_window: a key of the original Kronos format; here it is data.lookback"]
    with pytest.raises(ConfigError):
        csv_config.load(ROOT / "configs/csv_demo.yaml", ["training.basemodel_epochs=3"])


def test_kronos_print_config_of_an_original_file(capsys):
    assert cli.main(["finetune", "--config", str(ORIGINAL), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == config_to_dict(csv_config.load(ORIGINAL))


def test_kronos_finetune_runs_an_original_file_with_an_original_override(tmp_path, capsys):
    missing = tmp_path / "nowhere.csv"
    rc = cli.main(["finetune", "--config", str(ORIGINAL), "--set", f"data.data_path={missing}"])
    assert rc == 3  # the CSV loader's data check ran on the translated settings
    err = capsys.readouterr().err
    assert "is in the original Kronos finetune_csv format" in err  # each mapped key is logged first
    assert any(line.startswith(f"error: data.path: {missing} does not exist") for line in err.splitlines())
