"""Starting points of the two models: published weights (folder or hub id) or from scratch with the config's shape."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from finetune.utils.checkpoint import check_token_sizes, load_pretrained
from finetune_csv.config import FEATURES, CsvFinetuneConfig, ModelConfig
from model import Kronos, KronosTokenizer

BEST_DIR = "best_model"  # the training engine's published-format folder inside each stage's output folder


def build_tokenizer(cfg: ModelConfig) -> KronosTokenizer:
    """The tokenizer to finetune: `pretrained_tokenizer` loaded, or a fresh one with `tokenizer_arch`."""
    if cfg.pretrained_tokenizer is not None:
        return load_pretrained(KronosTokenizer, cfg.pretrained_tokenizer, "model.pretrained_tokenizer")
    return KronosTokenizer(d_in=len(FEATURES), **asdict(cfg.tokenizer_arch))


def build_predictor(cfg: ModelConfig, tokenizer: KronosTokenizer) -> Kronos:
    """The predictor to finetune: `pretrained_predictor` loaded, or a fresh one sized to the tokenizer's bits."""
    if cfg.pretrained_predictor is not None:
        predictor = load_pretrained(Kronos, cfg.pretrained_predictor, "model.pretrained_predictor")
    else:
        predictor = Kronos(s1_bits=tokenizer.s1_bits, s2_bits=tokenizer.s2_bits, **asdict(cfg.predictor_arch))
    check_token_sizes(tokenizer, predictor, "model.pretrained_tokenizer / model.pretrained_predictor / "
                                            "model.tokenizer_arch.s1_bits, s2_bits")
    return predictor


def best_dir(stage_dir: Path) -> Path:
    """Where a stage's best model (published format) lives."""
    return Path(stage_dir) / BEST_DIR


def predictor_tokenizer_source(cfg: CsvFinetuneConfig) -> str:
    """The tokenizer the predictor is trained with (and forecasts with): the finetuned one once it exists.

    Falls back to `model.pretrained_tokenizer` when the tokenizer stage has not produced a model (for instance
    with --skip-tokenizer); a from-scratch tokenizer that was never trained is an error, not a silent random one.
    """
    finetuned = best_dir(cfg.tokenizer_dir)
    if (finetuned / "config.json").is_file():
        return str(finetuned)
    if cfg.model.pretrained_tokenizer is not None:
        return cfg.model.pretrained_tokenizer
    raise ValueError(f"no trained tokenizer in {finetuned} and model.pretrained_tokenizer is null: train the "
                     "tokenizer first (drop --skip-tokenizer) or set model.pretrained_tokenizer")
