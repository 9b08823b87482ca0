"""Where the CSV pipeline's stages keep their models, and which tokenizer the predictor stage reads.

The models themselves are built by the shared factory (finetune/utils/factory.py).
"""

from __future__ import annotations

from pathlib import Path

from finetune_csv.config import CsvFinetuneConfig

BEST_DIR = "best_model"  # the training engine's published-format folder inside each stage's output folder


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
