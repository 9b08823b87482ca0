"""finetune/config.py: one error listing every bad setting by its YAML key; stage settings; entry-point checks."""

from __future__ import annotations

import pytest

from finetune import qlib_test, train_predictor, train_tokenizer
from finetune.config import QlibConfig, check_model_folder, load
from finetune.dataset import check_inputs
from finetune.utils.config_utils import Problems, load_config
from model.errors import ConfigError, UserError


def keys_of(err: ConfigError) -> list[str]:
    return sorted({p.split(":")[0] for p in err.problems})


def test_defaults_are_valid():
    assert load().problems().items == []


def test_every_problem_is_reported_at_once_with_its_key():
    overrides = [
        "data.val_time_range=[2024-06-30, 2023-01-01]",  # reversed: empty
        "data.test_time_range=[2022-06-01, 2025-06-05]",  # overlaps the training range
        "data.lookback=600",  # does not fit max_context
        "backtest.signals=[mean, median]",
        "backtest.n_drop=60",
        "forecast.top_p=0",
        "training.epochs=0",
        "predictor_training.lr=-1",
    ]
    with pytest.raises(ConfigError) as err:
        load(None, overrides)  # load validates
    assert keys_of(err.value) == sorted([
        "data.val_time_range", "data.test_time_range", "data.lookback", "backtest.signals", "backtest.n_drop",
        "forecast.top_p", "training.epochs", "predictor_training.lr",
    ])
    assert isinstance(err.value, ValueError)
    with pytest.raises(ConfigError) as again:  # the same problems from the settings object itself
        load_config(QlibConfig, None, overrides).validate()
    assert keys_of(again.value) == keys_of(err.value)


@pytest.mark.parametrize("override, key, says", [
    ("backtest.n_drop=0", "backtest.n_drop", "'drop all': the whole portfolio sold every day"),
    ("data.max_context=2", "data.max_context", "must be >= 3 (2 bars of context"),
])
def test_settings_that_make_results_meaningless_are_refused_by_key(override, key, says):
    with pytest.raises(ConfigError) as err:
        load(None, [override])
    assert keys_of(err.value) == [key] and says in str(err.value)


def test_unknown_universe_needs_an_explicit_benchmark():
    with pytest.raises(ConfigError) as err:
        load(None, ["data.instrument=my_pool"])
    assert keys_of(err.value) == ["backtest.benchmark"]
    load(None, ["data.instrument=my_pool", "backtest.benchmark=SH000905"])
    assert load(None, ["data.instrument=csi800"]).benchmark == "SH000906"


def test_ranges_outside_the_dataset_range_are_named():
    with pytest.raises(ConfigError) as err:
        load(None, ["data.dataset_end_time=2024-12-31"])
    assert keys_of(err.value) == ["data.test_time_range"]


def test_from_scratch_arguments_are_checked():
    with pytest.raises(ConfigError) as err:  # an unknown key is a load (type) error
        load(None, ["model.pretrained_tokenizer=null", "model.tokenizer_arch={d_in: 5, colour: red}"])
    assert "model.tokenizer_arch.colour" in str(err.value) and "unknown key" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load(None, ["model.pretrained_tokenizer=null", "model.tokenizer_arch.d_in=5", "model.tokenizer_arch.n_heads=3"])
    assert keys_of(err.value) == ["model.tokenizer_arch.d_in", "model.tokenizer_arch.n_heads"]
    # a pretrained tokenizer: its architecture settings are ignored, hence not checked
    load(None, ["model.tokenizer_arch.n_heads=3"])


def test_stage_settings_override_the_shared_loop():
    cfg = load(None, ["training.epochs=7", "predictor_training.epochs=2", "predictor_training.lr=4e-5"])
    tok, pred = cfg.stage_training("tokenizer"), cfg.stage_training("predictor")
    assert (tok.epochs, pred.epochs) == (7, 2)
    assert (tok.lr, pred.lr) == (cfg.training.lr, 4e-5)  # stage sections default to null = inherit training:
    assert pred.max_train_samples == tok.max_train_samples == 100_000


def test_model_folder_check(tmp_path):
    problems = Problems()
    check_model_folder("NeoQuasar/Kronos-small", "model.pretrained_predictor", problems, hub_ok=True)
    assert not problems
    check_model_folder(str(tmp_path / "nope"), "paths.finetuned_tokenizer_path", problems, hub_ok=False)
    check_model_folder("outputs/x", "paths.finetuned_predictor_path", problems, hub_ok=False)  # no hub for these
    (tmp_path / "empty").mkdir()
    check_model_folder(str(tmp_path / "empty"), "model.pretrained_tokenizer", problems, hub_ok=True)
    assert [p.split(":")[0] for p in problems.items] == [
        "paths.finetuned_tokenizer_path", "paths.finetuned_predictor_path", "model.pretrained_tokenizer"]


# ---- the entry points refuse bad input before any training or forecasting starts


def demo(tmp_path, *extra):
    return load("configs/qlib_demo.yaml", [
        f"data.qlib_data_path={tmp_path / 'qlib'}", f"data.dataset_path={tmp_path / 'processed'}",
        f"paths.save_path={tmp_path / 'models'}", *extra])


def test_tokenizer_stage_names_missing_splits_and_model(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_inputs(train_tokenizer.SPEC, demo(tmp_path, f"model.pretrained_tokenizer={tmp_path / 'no_tok'}"))
    assert keys_of(err.value) == ["data.dataset_path", "model.pretrained_tokenizer"]


def test_predictor_stage_needs_the_finetuned_tokenizer(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_inputs(train_predictor.SPEC, demo(tmp_path))
    assert keys_of(err.value) == ["data.dataset_path", "paths.finetuned_tokenizer_path"]


def test_backtest_names_every_missing_input(tmp_path):
    with pytest.raises(ConfigError) as err:
        qlib_test.check_inputs(demo(tmp_path))
    assert keys_of(err.value) == ["data.dataset_path", "data.qlib_data_path", "paths.finetuned_predictor_path",
                                  "paths.finetuned_tokenizer_path"]


@pytest.mark.parametrize("module", [train_tokenizer, train_predictor])
def test_trainers_started_with_plain_python_show_the_torchrun_command(module, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError) as err:
        module.main(["--config", "configs/qlib_demo.yaml"])
    expected = f"torchrun --standalone --nproc_per_node=1 {module.SPEC.script} --config configs/qlib_demo.yaml"
    assert expected in str(err.value)


def test_a_training_override_that_a_stage_section_shadows_is_warned_about(caplog):
    with caplog.at_level("WARNING"):
        cfg = load("configs/qlib_csi300.yaml", ["training.lr=1e-3", "training.batch_size=8"])
    assert (cfg.stage_training("tokenizer").lr, cfg.stage_training("predictor").lr) == (2e-4, 4e-5)
    warnings = sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert len(warnings) == 2  # lr is set by both stage sections; batch_size by neither
    assert "predictor_training.lr" in warnings[0] and "tokenizer_training.lr" in warnings[1]
    assert all("--set training.lr" in w for w in warnings)


@pytest.mark.parametrize("old", ["data.lookback_window=60", "data.predict_window=5", "inference.T=0.6",
                                 "model.pretrained_tokenizer_path=null", "model.tokenizer_args={}"])
def test_old_key_names_are_rejected(old):
    with pytest.raises(ConfigError, match="unknown key"):
        load(None, [old])
