"""model/'s forecaster entry points for in-memory and published pairs: KronosPredictor.from_models,
load_pretrained_pair, default_device."""
import pytest

import finetune.config as qlib_config
import finetune_csv.config as csv_config
from finetune.utils.config_utils import Problems
from model import KronosPredictor
from model.config import Window
from model.errors import DataError, PathError
from model.predictor import DEFAULT_MAX_CONTEXT, default_device, load_pretrained_pair
from tests.model_factory import tiny_models


def test_from_models_takes_the_recorded_window_and_calibration_unless_given():
    tok, pred = tiny_models(seed=3)
    calibration = {"method": "conformal", "space": "log_return", "levels": [0.5, 0.8],
                   "margins": [[0.01, 0.02], [0.03, 0.04]]}
    info = {"max_context": 40, "lookback": 30, "clip": 4.0, "calibration": calibration}
    p = KronosPredictor.from_models(pred, tok, info, device="cpu")
    assert (p.max_context, p.lookback, p.clip, p.calibration) == (40, 30, 4.0, calibration)
    p = KronosPredictor.from_models(pred, tok, info, device="cpu", max_context=16, clip=2.5)
    assert (p.max_context, p.lookback, p.clip) == (16, 30, 2.5)  # what the caller gives wins, field by field
    p = KronosPredictor.from_models(pred, tok, device="cpu")  # nothing recorded: the published defaults
    assert (p.max_context, p.lookback, p.clip) == (DEFAULT_MAX_CONTEXT, DEFAULT_MAX_CONTEXT, 5)
    with pytest.raises(DataError, match="max_context must be an integer >= 1"):
        KronosPredictor.from_models(pred, tok, info, device="cpu", max_context=0)  # an explicit 0 is not "unset"
    assert default_device() in ("cuda:0", "mps", "cpu")
    # A training window (a pipeline's data.window) replaces the recorded one whole; the calibration stays.
    p = KronosPredictor.from_models(pred, tok, info, device="cpu", window=Window(lookback=20, predict=4, clip=3.0))
    assert (p.max_context, p.lookback, p.clip, p.calibration) == (24, 20, 3.0, calibration)


def test_both_pipelines_settings_give_the_engine_one_window():
    csv, qlib = csv_config.CsvFinetuneConfig(), qlib_config.QlibConfig()
    csv.data.lookback, csv.data.predict, csv.data.clip = 64, 16, 4.0
    assert csv.data.window == Window(64, 16, 4.0) and csv.data.window.size == 80
    assert qlib.data.window.size == qlib.data.lookback + qlib.data.predict == 100
    assert Window(64, 16, 4.0).info() == {"max_context": 80, "lookback": 64, "clip": 4.0}  # kronos_predictor.json
    for data in (csv.data, qlib.data):  # one bar has no spread to normalise by: both pipelines refuse it alike
        data.lookback, data.clip, problems = 1, 0, Problems()
        data.check_window(problems)
        assert [p.split(":")[0] for p in problems.items] == ["data.lookback", "data.clip"]


def test_load_pretrained_pair_loads_both_and_names_the_setting_that_failed(tmp_path):
    tok, pred = tiny_models(seed=3)
    tok.save_pretrained(tmp_path / "tok")
    pred.save_pretrained(tmp_path / "pred")
    model, tokenizer = load_pretrained_pair(tmp_path / "pred", tmp_path / "tok")
    assert model.config == pred.config and tokenizer.config == tok.config
    with pytest.raises(PathError, match="model.pretrained_predictor: cannot load Kronos"):
        load_pretrained_pair(tmp_path / "missing", tmp_path / "tok")
    with pytest.raises(PathError, match="model.pretrained_tokenizer: cannot load KronosTokenizer"):
        load_pretrained_pair(tmp_path / "pred", tmp_path / "missing")
    (tmp_path / "pred" / "config.json").write_text('{"s1_bits": "many"}')
    with pytest.raises(DataError, match="model.pretrained_predictor: cannot load Kronos"):
        load_pretrained_pair(tmp_path / "pred", tmp_path / "tok")
