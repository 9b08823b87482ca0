"""Kronos model package: tokenizer, predictor and forecaster, compatible with the published checkpoints.

The public names below load on first access (PEP 562), so `import model.config` / `import model.features` (what
config readers need) does not import torch; `from model import KronosPredictor` works as usual."""
from __future__ import annotations

import importlib

_PUBLIC = {"Forecast": "model.predictor", "Kronos": "model.kronos", "KronosPredictor": "model.predictor",
           "KronosTokenizer": "model.tokenizer", "calc_time_stamps": "model.features",
           "generate_tokens": "model.generation", "sample_from_logits": "model.generation"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
