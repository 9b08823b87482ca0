"""finetune/utils/stages.py's model factory of both pipelines (pretrained or from scratch, paired bits)."""

from __future__ import annotations

import pytest
import torch

from finetune.utils.config_utils import Problems
from finetune.utils.schema import ModelConfig
from finetune.utils.stages import build_predictor, build_tokenizer
from model import Kronos, KronosTokenizer
from model.config import KronosConfig, KronosTokenizerConfig
from model.errors import PathError
from tests.model_factory import TINY_PREDICTOR, TINY_TOKENIZER

TOK_ARCH = KronosTokenizerConfig(**TINY_TOKENIZER)
PRED_ARCH = KronosConfig(**{**TINY_PREDICTOR, "s1_bits": None, "s2_bits": None})


def test_from_scratch_models_equal_direct_construction_and_take_the_tokenizers_bits():
    torch.manual_seed(0)
    tok = build_tokenizer(None, TOK_ARCH, "model")
    pred = build_predictor(None, PRED_ARCH, tok, "model")
    torch.manual_seed(0)
    ref_tok, ref_pred = KronosTokenizer(**TINY_TOKENIZER), Kronos(**TINY_PREDICTOR)  # same init RNG order
    for a, b in ((tok, ref_tok), (pred, ref_pred)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert (pred.s1_bits, pred.s2_bits) == (4, 4)


def test_pretrained_folders_are_loaded_and_the_arch_ignored(tmp_path):
    torch.manual_seed(1)
    KronosTokenizer(**TINY_TOKENIZER).save_pretrained(tmp_path / "tok")
    Kronos(**TINY_PREDICTOR).save_pretrained(tmp_path / "pred")
    bogus = KronosTokenizerConfig(n_heads=3)  # would be invalid, but a pretrained folder wins
    tok = build_tokenizer(str(tmp_path / "tok"), bogus, "model")
    pred = build_predictor(str(tmp_path / "pred"), KronosConfig(s1_bits=9), tok, "model")
    assert tok.d_model == 16 and pred.s1_bits == 4


def test_bits_that_differ_from_the_tokenizer_name_the_keys(tmp_path):
    tok = build_tokenizer(None, TOK_ARCH, "model")
    with pytest.raises(ValueError, match=r"model\.predictor_arch\.s1_bits: is 6 but the tokenizer"):
        build_predictor(None, KronosConfig(**{**TINY_PREDICTOR, "s1_bits": 6, "s2_bits": None}), tok, "model")
    Kronos(**{**TINY_PREDICTOR, "s1_bits": 6, "s2_bits": 6}).save_pretrained(tmp_path / "p6")
    with pytest.raises(ValueError, match=r"paths\.finetuned_tokenizer_path / model\.pretrained_predictor"):
        build_predictor(str(tmp_path / "p6"), PRED_ARCH, tok, "model", tokenizer_key="paths.finetuned_tokenizer_path")


def test_missing_folder_and_bad_arch_are_errors_naming_the_setting(tmp_path):
    with pytest.raises(PathError, match="model.pretrained_tokenizer"):
        build_tokenizer(str(tmp_path / "nope"), TOK_ARCH, "model")
    with pytest.raises(ValueError, match=r"model\.tokenizer_arch\.n_heads"):
        build_tokenizer(None, KronosTokenizerConfig(d_model=30, n_heads=4), "model")


def test_model_settings_check_only_what_is_used():
    p = Problems()
    ModelConfig(tokenizer_arch=KronosTokenizerConfig(n_heads=3)).check(p)  # pretrained: arch ignored
    assert not p
    cfg = ModelConfig(pretrained_tokenizer=None, pretrained_predictor=None,
                      tokenizer_arch=KronosTokenizerConfig(d_in=5, s1_bits=6, s2_bits=6),
                      predictor_arch=KronosConfig(s1_bits=8, d_model=30))
    cfg.check(p, "model")
    keys = sorted(item.split(":")[0] for item in p.items)
    assert keys == ["model.predictor_arch.d_model", "model.predictor_arch.n_heads", "model.predictor_arch.s1_bits",
                    "model.tokenizer_arch.d_in"]
    p = Problems()
    ModelConfig(pretrained_predictor=" ").check(p)
    assert [item.split(":")[0] for item in p.items] == ["model.pretrained_predictor"]
