"""Kronos model package: tokenizer, predictor and forecaster, compatible with the published checkpoints."""
from .features import calc_time_stamps
from .generation import generate_tokens, sample_from_logits
from .kronos import Kronos
from .predictor import Forecast, KronosPredictor
from .tokenizer import KronosTokenizer

__all__ = ["Forecast", "Kronos", "KronosPredictor", "KronosTokenizer", "calc_time_stamps", "generate_tokens",
           "sample_from_logits"]
