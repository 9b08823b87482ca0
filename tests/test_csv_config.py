"""Settings of the CSV pipeline: YAML + --set overrides into dataclasses, one error listing every problem."""

from __future__ import annotations

import pytest

from finetune_csv.config import CsvFinetuneConfig, load, validate


def write_yaml(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_fill_the_dataclasses(tmp_path):
    path = write_yaml(tmp_path, "data:\n  path: x.csv\n  lookback: 16\npaths:\n  exp_name: e1\n")
    cfg = load(path, ["training.epochs=3", "data.columns.close=Close", "model.pretrained_tokenizer=null"])
    assert cfg.data.lookback == 16 and cfg.data.columns.close == "Close"
    assert cfg.stage_training("tokenizer").epochs == cfg.stage_training("predictor").epochs == 3
    assert cfg.model.pretrained_tokenizer is None
    assert str(cfg.base_dir) == "outputs/e1" and cfg.predictor_dir.name == "basemodel"


def test_stage_settings_override_the_shared_training_section(tmp_path):
    text = "data: {path: x.csv}\ntraining: {epochs: 5, lr: 1.0e-3, batch_size: 8}\n" \
           "tokenizer_training: {epochs: 0}\npredictor_training: {lr: null, batch_size: 4}\n"
    cfg = load(write_yaml(tmp_path, text))
    tok, pred = cfg.stage_training("tokenizer"), cfg.stage_training("predictor")
    assert (tok.epochs, tok.lr, tok.batch_size) == (0, 1e-3, 8)  # stage sections default to null = inherit
    assert (pred.epochs, pred.lr, pred.batch_size) == (5, 1e-3, 4)  # null falls back to training.lr
    assert cfg.training.resume == "auto"  # as in the Qlib pipeline: continue from checkpoints/last.pt


def test_unknown_key_and_wrong_type_are_reported_with_their_yaml_keys(tmp_path):
    path = write_yaml(tmp_path, "data:\n  path: x.csv\n  lookbak: 16\ntraining:\n  batch_size: many\n")
    with pytest.raises(ValueError) as info:
        load(path)
    msg = str(info.value)
    assert "data.lookbak: unknown key" in msg and "training.batch_size: expected int" in msg


def test_validate_lists_every_problem_at_once():
    cfg = CsvFinetuneConfig()
    cfg.data.path = ""
    cfg.data.lookback = 0
    cfg.data.val_ratio = 0.0
    cfg.predictor_training.lr = -1.0
    cfg.model.pretrained_tokenizer = None
    cfg.model.tokenizer_arch.s2_bits = 6  # 10 + 6 is still a multiple of group_size 4
    with pytest.raises(ValueError) as info:
        validate(cfg)
    msg = str(info.value)
    for key in ("data.path", "data.lookback", "data.val_ratio", "data.train_ratio", "predictor_training.lr",
                "model.tokenizer_arch.s2_bits"):
        assert key in msg, key
    assert "(6 problems)" in msg


def test_architecture_is_only_checked_when_training_from_scratch():
    cfg = CsvFinetuneConfig()
    cfg.data.path = "x.csv"
    cfg.model.tokenizer_arch.s2_bits = 4  # ignored: a pretrained tokenizer is used
    validate(cfg)  # no error
    cfg.model.pretrained_tokenizer = None  # from scratch: the architecture is checked
    with pytest.raises(ValueError, match=r"model\.tokenizer_arch\.s2_bits: must equal s1_bits"):
        validate(cfg)


def test_ratios_must_sum_to_one():
    cfg = CsvFinetuneConfig()
    cfg.data.path = "x.csv"
    cfg.data.train_ratio, cfg.data.val_ratio, cfg.data.test_ratio = 0.7, 0.2, 0.2
    with pytest.raises(ValueError, match="must be 1"):
        validate(cfg)


def test_a_training_override_that_a_stage_section_shadows_is_warned_about(tmp_path, caplog):
    path = write_yaml(tmp_path, "data: {path: x.csv}\ntokenizer_training: {lr: 2.0e-4}\n")
    with caplog.at_level("WARNING"):
        cfg = load(path, ["training.lr=1e-3", "training.epochs=2"])
    assert cfg.stage_training("tokenizer").lr == 2e-4 and cfg.stage_training("predictor").lr == 1e-3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1  # epochs is not shadowed, the predictor stage inherits lr
    assert "training.lr" in warnings[0] and "tokenizer_training.lr" in warnings[0]


def test_old_key_names_are_rejected_with_the_known_keys(tmp_path):
    path = write_yaml(tmp_path, "data: {path: x.csv}\nmodel: {tokenizer_args: {}}\n")
    with pytest.raises(ValueError, match=r"model\.tokenizer_args: unknown key .*tokenizer_arch"):
        load(path)


def test_a_column_name_with_a_colon_can_be_set_on_the_command_line(tmp_path):
    cfg = load(write_yaml(tmp_path, "data: {path: x.csv}\n"), ["data.columns.timestamps=Unnamed: 0"])
    assert cfg.data.columns.timestamps == "Unnamed: 0"
