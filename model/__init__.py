"""Kronos model package: tokenizer, predictor and forecaster, compatible with the published checkpoints."""
from model.features import calc_time_stamps
from model.generation import generate_tokens, sample_from_logits
from model.kronos import Kronos
from model.predictor import Forecast, KronosPredictor
from model.tokenizer import KronosTokenizer

__all__ = ["Forecast", "Kronos", "KronosPredictor", "KronosTokenizer", "calc_time_stamps", "generate_tokens",
           "sample_from_logits"]
