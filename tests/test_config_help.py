"""finetune/utils/config_utils.py: the key listing is generated from the config dataclasses (types, defaults,
docstrings) and every listed key is real; --help-config / --print-config on a parser and through `kronos`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

import finetune_csv.config as csv_config
from finetune import cli
from finetune.config import QlibConfig
from finetune.config import load as load_qlib_config
from finetune.utils.cli_args import (
    KeyDoc,
    SectionDoc,
    _show_default,
    add_config_args,
    describe_config,
    field_docs,
    format_config_help,
    parse_config_args,
)
from finetune.utils.config_utils import config_to_dict, load_config
from finetune_csv.config import CsvFinetuneConfig

ROOT = Path(__file__).resolve().parents[1]
CLASSES = [CsvFinetuneConfig, QlibConfig]


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _norm(v):
    return config_to_dict(v)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_listed_key_is_a_real_key_and_its_default_round_trips(cls):
    """`key=<default as shown>` loads and gives the default back: names, types and shown defaults are right."""
    keys = [d for d in describe_config(cls) if isinstance(d, KeyDoc)]
    assert len(keys) > 20
    defaults = load_config(cls, None, [])  # templates such as {exp_name} resolved, as in cfg
    overrides = [f"{d.key}={_show_default(d.default)}" for d in keys]
    cfg = load_config(cls, None, overrides)
    for d in keys:
        assert _norm(_get(cfg, d.key)) == _norm(_get(defaults, d.key)), d.key


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_leaf_of_the_config_is_listed_once(cls):
    def leaves(obj, prefix=""):
        for f in dataclasses.fields(obj):
            key = f"{prefix}.{f.name}" if prefix else f.name
            value = getattr(obj, f.name)
            yield from (leaves(value, key) if dataclasses.is_dataclass(value) else [key])

    listed = [d.key for d in describe_config(cls) if isinstance(d, KeyDoc)]
    assert sorted(listed) == sorted(leaves(cls()))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_key_and_section_has_its_docstring(cls):
    missing = [d.key for d in describe_config(cls) if not d.doc]
    assert not missing, f"fields without a docstring: {missing}"


def test_docstrings_types_and_defaults_come_from_the_source():
    docs = {d.key: d for d in describe_config(CsvFinetuneConfig) if isinstance(d, KeyDoc)}
    lookback = docs["data.lookback"]
    assert (lookback.type, lookback.default) == ("int", 512)
    assert lookback.doc == "Context candles per window (the tokenizer/predictor input)."
    assert docs["data.nan_policy"].type == "'error' | 'ffill' | 'drop'"
    assert docs["model.pretrained_tokenizer"].type == "str | null"
    assert docs["training.betas"].type == "tuple[float, float]"
    # inherited fields keep the base class's docstring; a subclass's own default and docstring win
    assert docs["training.epochs"].doc.startswith("Passes over the")
    assert docs["training.resume"].default == "auto" and docs["training.resume"].doc.startswith("'auto' = continue")
    assert docs["training.num_workers"].default == 0 and docs["training.num_workers"].doc.startswith("DataLoader")
    assert field_docs(CsvFinetuneConfig)["data"] == "Input candles and windows."


def test_listing_groups_keys_under_their_section():
    text = format_config_help(CsvFinetuneConfig)
    lines = text.splitlines()
    assert "data:  # Input candles and windows." in lines
    assert '  data.nan_policy: \'error\' | \'ffill\' | \'drop\' = "error"' in lines
    # data's own keys come before its subsection, so no key is shown under a foreign header
    assert lines.index("  data.symbol_column: str | null = null") < lines.index(
        "data.columns:  # Column mapping: the name in your CSV of each field.")
    sections = [d for d in describe_config(CsvFinetuneConfig) if isinstance(d, SectionDoc)]
    current = ""
    for item in describe_config(CsvFinetuneConfig):
        if isinstance(item, SectionDoc):
            current = item.key
        else:
            assert item.key.rsplit(".", 1)[0] == current, item.key
    assert {s.key for s in sections} >= {"data", "data.columns", "model.tokenizer_arch", "forecast"}


def _parser():
    parser = add_config_args(argparse.ArgumentParser(prog="train"), CsvFinetuneConfig, csv_config.load)
    parser.add_argument("--resume", action="store_true")  # --config is required here
    return parser


def test_help_config_flag_prints_and_exits_without_config(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config_args(_parser(), ["--help-config"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("Settings of CsvFinetuneConfig") and "  predictor_training.lr: float | null = null" in out


def test_print_config_flag_prints_resolved_yaml(capsys, tmp_path):
    cfg_path = ROOT / "configs/csv_demo.yaml"
    with pytest.raises(SystemExit) as exit_:
        parse_config_args(_parser(), ["--config", str(cfg_path), "--set", "training.epochs=7", "--print-config"])
    assert exit_.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = config_to_dict(csv_config.load(cfg_path, ["training.epochs=7"]))
    assert printed == expected and printed["training"]["epochs"] == 7
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(printed))
    assert config_to_dict(csv_config.load(tmp_path / "again.yaml")) == expected  # it loads back


def test_parser_without_the_flags_is_unchanged():
    args = parse_config_args(_parser(), ["--config", "x.yaml", "--resume"])
    assert args.config == "x.yaml" and args.resume and args.print_config is False


def test_kronos_help_config_and_print_config(capsys):
    assert cli.main(["qlib-backtest", "--help-config"]) == 0
    assert capsys.readouterr().out.startswith("Settings of QlibConfig")
    rc = cli.main(["qlib-train-predictor", "--config", str(ROOT / "configs/qlib_demo.yaml"), "--set",
                   "data.instrument=csi800", "--print-config"])  # no torchrun needed to print settings
    assert rc == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == config_to_dict(load_qlib_config(str(ROOT / "configs/qlib_demo.yaml"), ["data.instrument=csi800"]))


def test_kronos_print_config_reports_bad_settings(capsys):
    rc = cli.main(["finetune", "--config", str(ROOT / "configs/csv_demo.yaml"), "--set", "data.clip=-1",
                   "--print-config"])
    assert rc == 2
    assert "data.clip" in capsys.readouterr().err
