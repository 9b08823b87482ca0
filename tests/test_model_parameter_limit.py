"""A config.json whose fields are each within bounds but whose model would need terabytes is
refused before anything is allocated, naming the file and the parameter count."""
import functools
import json
from dataclasses import asdict

import pytest

from model import Kronos, KronosTokenizer
from model.config import KronosConfig, KronosTokenizerConfig
from tests.model_factory import TINY_PREDICTOR, TINY_TOKENIZER


@pytest.mark.parametrize("cls, config_class, kwargs", [
    (Kronos, KronosConfig, TINY_PREDICTOR),
    (Kronos, KronosConfig, {**TINY_PREDICTOR, "learn_te": False, "n_layers": 3, "s2_bits": 5}),
    (Kronos, KronosConfig, asdict(KronosConfig(s1_bits=10, s2_bits=10))),  # Kronos-small
    (KronosTokenizer, KronosTokenizerConfig, TINY_TOKENIZER),
    (KronosTokenizer, KronosTokenizerConfig, {**TINY_TOKENIZER, "n_enc_layers": 4, "ff_dim": 24}),
])
def test_parameter_count_from_the_config_equals_the_built_model(cls, config_class, kwargs):
    assert config_class(**kwargs).parameter_count() == sum(p.numel() for p in cls(**kwargs).parameters())


def test_a_huge_config_json_is_refused_before_allocation(tmp_path, monkeypatch):
    cfg = {**TINY_PREDICTOR, "d_model": 16384, "n_heads": 128, "ff_dim": 65536, "n_layers": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expected = KronosConfig(**cfg).parameter_count()
    assert expected > 1e12  # each field within its bound, the whole ~4 TB of float32

    @functools.wraps(Kronos.__init__)  # keeps the signature from_pretrained reads the argument names from
    def never(*a, **k):
        raise AssertionError("the model must not be built")
    monkeypatch.setattr(Kronos, "__init__", never)
    with pytest.raises(ValueError) as info:
        Kronos.from_pretrained(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "config.json") in message and f"{expected:,} parameters" in message
    assert "max_parameters" in message and "2,000,000,000" in message
    # The limit is a setting: raised above the count, loading goes on (and stops at the missing weights file).
    with pytest.raises(FileNotFoundError, match="model.safetensors not found"):
        Kronos.from_pretrained(tmp_path, max_parameters=2e12)


def test_a_huge_tokenizer_config_is_refused(tmp_path):
    cfg = {**TINY_TOKENIZER, "d_model": 16384, "n_heads": 64, "ff_dim": 65536, "n_enc_layers": 256,
           "n_dec_layers": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="describes a KronosTokenizer of .* parameters, above the limit"):
        KronosTokenizer.from_pretrained(tmp_path)
