"""Config loader: nested dataclasses from YAML, --set overrides, templates, one error listing every problem."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from finetune.utils.cli_args import add_config_args, parse_config_args
from finetune.utils.config_utils import Problems, config_to_dict, dump_config, load_config
from finetune.utils.schema import TrainingConfig, validate_training_config
from model.errors import ConfigError


@dataclass
class DataSection:
    """Data settings."""

    path: str = "data/x.csv"
    """Input file."""
    lookback: int = 90
    """Context rows."""
    ratio: float = 0.9
    """Train share."""
    volume: str | None = "volume"
    """Optional column."""


@dataclass
class TrainSection:
    """Training settings."""

    epochs: int = 10
    """Epochs."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    amp: Literal["none", "bf16"] = "none"
    """Precision."""
    shuffle: bool = True
    """Shuffle."""


@dataclass
class Root:
    """Whole config."""

    exp_name: str = "demo"
    """Experiment name."""
    output_dir: str = "outputs/{exp_name}"
    """Output folder (template)."""
    data: DataSection = field(default_factory=DataSection)
    """Data."""
    training: TrainSection = field(default_factory=TrainSection)
    """Training."""
    tags: list[str] = field(default_factory=list)
    """Free tags."""


def write_yaml(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_yaml_fills_nested_sections_and_keeps_defaults(tmp_path):
    path = write_yaml(tmp_path, {"exp_name": "btc", "data": {"lookback": 64}, "training": {"betas": [0.8, 0.9]}})
    cfg = load_config(Root, path)
    assert cfg.data.lookback == 64 and cfg.data.path == "data/x.csv"
    assert cfg.training.betas == (0.8, 0.9)
    assert cfg.output_dir == "outputs/btc"  # template resolved from another field


def test_overrides_are_yaml_scalars_applied_after_the_file(tmp_path):
    path = write_yaml(tmp_path, {"training": {"epochs": 3}})
    cfg = load_config(Root, path, ["training.epochs=7", "data.ratio=1e-1", "training.shuffle=false",
                                   "data.volume=null", "exp_name=run2", "training.betas=[0.5, 0.6]"])
    assert cfg.training.epochs == 7
    assert cfg.data.ratio == pytest.approx(0.1) and isinstance(cfg.data.ratio, float)
    assert cfg.training.shuffle is False
    assert cfg.data.volume is None
    assert cfg.output_dir == "outputs/run2"
    assert cfg.training.betas == (0.5, 0.6)


def test_every_problem_is_reported_once_with_its_yaml_key(tmp_path):
    path = write_yaml(tmp_path, {"training": {"epochs": "ten", "amp": "fp8", "epocs": 3}, "data": {"lookback": 1.5}})
    with pytest.raises(ConfigError) as err:
        load_config(Root, path, ["data.nope=1", "training.shuffle=maybe"])
    message = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "training.epochs: expected int, got 'ten'" in message
    assert "training.amp: expected one of 'none' | 'bf16', got 'fp8'" in message
    assert "training.epocs: unknown key (did you mean 'training.epochs'?" in message
    assert "data.lookback: expected int, got 1.5" in message
    assert "data.nope: unknown key (known keys here:" in message  # nothing close: no guess
    assert "training.shuffle: expected bool" in message
    assert len(err.value.problems) == 6
    with pytest.raises(ConfigError, match=r"training\.epoch: unknown key \(did you mean 'training\.epochs'\?"):
        load_config(Root, None, ["training.epoch=4"])  # a --set key gets the same hint


def test_section_given_a_scalar_and_bad_override_syntax_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"data: expected a mapping"):
        load_config(Root, write_yaml(tmp_path, {"data": 5}))
    with pytest.raises(ConfigError, match=r"expected KEY=VALUE"):
        load_config(Root, None, ["training.epochs"])


def test_unknown_template_and_cycles_are_errors():
    with pytest.raises(ConfigError, match=r"output_dir: template \{missing\} names no setting"):
        load_config(Root, None, ["output_dir=out/{missing}"])
    with pytest.raises(ConfigError, match=r"cycle|itself"):
        load_config(Root, None, ["exp_name={output_dir}", "output_dir={exp_name}"])


def test_dotted_and_chained_templates():
    cfg = load_config(Root, None, ["exp_name=a{data.lookback}", "data.path={output_dir}/x.csv"])
    assert cfg.exp_name == "a90"
    assert cfg.data.path == "outputs/a90/x.csv"


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(Root, tmp_path / "nope.yaml")


def test_argparse_round_trip_and_dict_export(tmp_path):
    path = write_yaml(tmp_path, {"training": {"epochs": 2}})
    parser = add_config_args(argparse.ArgumentParser(), Root, lambda path, sets: load_config(Root, path, sets))
    args = parse_config_args(parser, ["--config", str(path), "--set", "training.epochs=4", "--set", "data.lookback=8"])
    cfg = args.load_config_fn(args.config, args.set)
    assert (cfg.training.epochs, cfg.data.lookback) == (4, 8)
    exported = config_to_dict(cfg)
    assert exported["training"]["betas"] == [0.9, 0.95]
    # The dump loads back into an equal config.
    (tmp_path / "dump.yaml").write_text(dump_config(cfg))
    assert load_config(Root, tmp_path / "dump.yaml") == cfg


def test_problems_collects_and_raises_one_value_error():
    problems = Problems()
    assert problems.check(True, "a", "never shown")
    assert not problems.check(False, "training.lr", "must be > 0, got -1")
    problems.add("data.path", "file not found")
    with pytest.raises(ValueError) as err:
        problems.raise_if_any()
    assert err.value.problems == ["training.lr: must be > 0, got -1", "data.path: file not found"]
    Problems().raise_if_any()  # nothing collected: no error


def test_training_config_loads_from_yaml_and_validation_names_keys(tmp_path):
    @dataclass
    class Pipeline:
        training: TrainingConfig = field(default_factory=TrainingConfig)

    cfg = load_config(Pipeline, write_yaml(tmp_path, {"training": {"epochs": 3, "max_train_samples": None}}))
    assert cfg.training.epochs == 3
    bad = TrainingConfig(epochs=0, batch_size=0, lr=-1.0, pct_start=1.5, betas=(0.9, 1.2), patience=-1)
    problems = Problems()
    validate_training_config(bad, problems, prefix="predictor_training")
    keys = [p.split(":")[0] for p in problems.items]
    assert keys == [f"predictor_training.{k}" for k in ("epochs", "batch_size", "lr", "betas", "pct_start", "patience")]


def test_unquoted_template_in_yaml_gets_a_quoting_hint(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("output_dir: {exp_name}\n")  # YAML reads this as a mapping
    with pytest.raises(ConfigError, match=r'output_dir: expected str.*quote templates in YAML: "\{exp_name\}"'):
        load_config(Root, path)


def test_a_str_setting_takes_the_raw_override_text():
    # YAML would read `Unnamed: 0` as a mapping and `3` as an int; a str field wants the text as typed.
    cfg = load_config(Root, None, ["data.path=Unnamed: 0", "exp_name=3", "data.volume=Vol: total"])
    assert (cfg.data.path, cfg.exp_name, cfg.data.volume) == ("Unnamed: 0", "3", "Vol: total")
    cfg = load_config(Root, None, ["data.volume=null", 'data.path="quoted: yes"', "data.lookback=7"])
    assert cfg.data.volume is None and cfg.data.path == "quoted: yes" and cfg.data.lookback == 7
    assert load_config(Root, None, ["tags=[a, b]"]).tags == ["a", "b"]  # non-str fields still read YAML
    with pytest.raises(ConfigError, match="data.lookback: expected int"):
        load_config(Root, None, ["data.lookback=Unnamed: 0"])
