"""Finetune Kronos from Python: the CSV pipeline's checks and engine as one call, for notebooks and scripts.

The frames go, as they are, through exactly what `finetune_csv/train_sequential.py` does (`run_finetune`: the data
store with every check, the tokenizer stage, the predictor stage); a data error names the frame and column
(`frame 'AAPL': column 'close' ...`). Nothing here calls `sys.exit` or parses a command line; a user mistake raises
a UserError / ValueError whose message names the setting to change."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

import finetune_csv.config as csv_config
from finetune.utils.errors import setup_logging
from finetune_csv.config import CsvFinetuneConfig, best_dir
from finetune_csv.train_sequential import run_finetune
from model.errors import ConfigError

_SECTIONS = ("data", "model", "training", "tokenizer_training", "predictor_training", "paths")


@dataclass(frozen=True)
class FinetuneResult:
    """What a finetuning run produced."""

    output_dir: Path  # The run's output folder (paths.base_dir).
    # best_model/ of the tokenizer the predictor uses (finetuned, or None when a published one was used).
    tokenizer_dir: Path | None
    predictor_dir: Path | None  # best_model/ of the finetuned predictor (None when the predictor stage did not run).
    # Per trained stage: best_val_loss, best_epoch (0 = the starting model, trained epochs count from 1), epochs
    # (trained), steps, history (one dict per epoch, epoch 0 included).
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # Stages that did not train, and why.
    # The data summary recorded in run_info.json (files with sha256, series, splits, store).
    data: dict[str, Any] = field(default_factory=dict)
    config: CsvFinetuneConfig | None = None  # The resolved configuration that ran.


def finetune(data: pd.DataFrame | Mapping[str, pd.DataFrame] | str | Path, *, config: str | Path | None = None,
             overrides: Mapping[str, Any] | None = None, output_dir: str | Path | None = None,
             **settings: Any) -> FinetuneResult:
    """Finetune the tokenizer and the predictor on `data`; the same checks and engine as the CLI.

    data: a DataFrame of one series (what `predict_df` accepts: columns in any case with the common aliases, or a
        DatetimeIndex), a dict {series name: DataFrame}, or a path for `data.path` (a CSV/Parquet file or folder).
    config: YAML file to start from (None = the defaults: the published Kronos-small pair).
    overrides: {dotted key: value}, applied after the YAML, e.g. {"data.timezone": "America/New_York"}.
    settings: short field names (e.g. epochs=2, lookback=64), each naming exactly one field of the config's sections
        (a `training:` field wins over the per-stage sections, which inherit it)."""
    if not logging.getLogger().handlers:  # a notebook or script without logging: show progress like the CLI
        setup_logging()
    values = {k.replace("__", "."): v for k, v in (overrides or {}).items()}
    values.update({_resolve_short_name(name): value for name, value in settings.items()})
    if output_dir is not None:
        values["paths.base_dir"] = str(output_dir)
    frames = None if isinstance(data, (str, Path)) else _frames(data)
    values["data.path"] = str(data) if frames is None else "frames: " + ", ".join(frames)
    cfg = csv_config.load(config, values=values)
    created = [p for p in [cfg.base_dir, *cfg.base_dir.parents] if not p.exists()]
    try:
        results, plan, data_info = run_finetune(cfg, frames=frames)
    except BaseException:
        for p in created:  # a failed first run leaves no folder behind (the store already removed itself)
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        raise
    return _result(cfg, results, plan, data_info)


def _frames(data: pd.DataFrame | Mapping[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """{series name: frame}; one DataFrame is the series 'series'."""
    frames = {"series": data} if isinstance(data, pd.DataFrame) else dict(data) if isinstance(data, Mapping) else {}
    if not frames or not all(isinstance(f, pd.DataFrame) for f in frames.values()):
        raise ConfigError(["finetune(data=...): give a DataFrame, a dict {name: DataFrame} or a path"])
    return {str(k): v for k, v in frames.items()}


def _resolve_short_name(name: str) -> str:
    """'epochs' -> 'training.epochs'; a name in several sections or none is a ConfigError."""
    if "." in name or "__" in name:
        return name.replace("__", ".")
    owners = [s for s in _SECTIONS if name in {f.name for f in dataclasses.fields(
        type(getattr(CsvFinetuneConfig(), s)))}]
    if "training" in owners:  # the stage sections inherit from training: (their null = training's value)
        owners = [s for s in owners if not s.endswith("_training")]
    if len(owners) == 1:
        return f"{owners[0]}.{name}"
    where = f"it is a field of {', '.join(owners)}" if owners else "no config section has it"
    raise ConfigError([f"finetune(..., {name}=...): {where}; pass overrides={{'<section>.{name}': ...}}"])


def _result(cfg: CsvFinetuneConfig, results: list, plan: dict[str, str | None], data_info: dict) -> FinetuneResult:
    metrics = {
        r.stage: {"best_val_loss": r.best_val_loss, "best_epoch": r.best_epoch,
                  "epochs": sum(1 for h in r.history if h["epoch"] > 0), "steps": r.global_step, "history": r.history}
        for r in results
    }
    tok, pred = best_dir(cfg.tokenizer_dir), best_dir(cfg.predictor_dir)
    return FinetuneResult(output_dir=cfg.base_dir, tokenizer_dir=tok if (tok / "config.json").is_file() else None,
                          predictor_dir=pred if (pred / "config.json").is_file() else None, metrics=metrics,
                          skipped={k: v for k, v in plan.items() if v is not None}, data=data_info, config=cfg)
