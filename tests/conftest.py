"""Shared fixtures: tiny Kronos models (one implementation: tests/model_factory.py)."""
from __future__ import annotations

import pytest

from tests import model_factory


@pytest.fixture
def tiny_pair():
    """(tokenizer, predictor), width 16, eval mode, seed 0."""
    return model_factory.tiny_models()


@pytest.fixture
def make_tiny_models():
    """`model_factory.tiny_models(seed=0, **predictor_overrides)` -> (tokenizer, predictor) in eval mode."""
    return model_factory.tiny_models


@pytest.fixture
def make_tiny_tokenizer():
    """`model_factory.tiny_tokenizer(seed=0, dropout=None, **overrides)` (training mode)."""
    return model_factory.tiny_tokenizer


@pytest.fixture
def make_tiny_predictor():
    """`model_factory.tiny_predictor(seed=1, dropout=None, **overrides)` (training mode)."""
    return model_factory.tiny_predictor
