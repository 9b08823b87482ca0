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

    Falls back to `model.pretrained_tokenizer` when the tokenizer stage never ran (for instance with
    --skip-tokenizer); an interrupted tokenizer stage and a from-scratch tokenizer that was never trained are errors,
    not a silent half-trained or random one.
    """
    from finetune.utils.training_utils import stage_status

    folder, finetuned = Path(cfg.tokenizer_dir), best_dir(cfg.tokenizer_dir)
    interrupted = stage_status(folder) == "unfinished" and any(
        (folder / name).exists() for name in ("checkpoints", "run_info.json", "metrics.jsonl"))
    if interrupted:  # never train or forecast on a half-trained tokenizer (issue 8, observation 6)
        raise ValueError(f"the tokenizer stage in {folder} is unfinished: run it to the end first (drop "
                         "--skip-tokenizer; it resumes where it stopped) or use another paths.base_dir")
    if (finetuned / "config.json").is_file():  # a finished stage's model, or one placed there by hand
        return str(finetuned)
    if cfg.model.pretrained_tokenizer is not None:
        return cfg.model.pretrained_tokenizer
    raise ValueError(f"no trained tokenizer in {finetuned} and model.pretrained_tokenizer is null: train the "
                     "tokenizer first (drop --skip-tokenizer) or set model.pretrained_tokenizer")
