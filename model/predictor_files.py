"""What `KronosPredictor.from_pretrained` reads beside a predictor: `kronos_predictor.json`.

A finetuned predictor folder (the engine's `best_model/`) holds config.json + model.safetensors (published format),
`tokenizer_config.json` (the tokenizer it was trained with, config only) and, when the run wrote it,
`kronos_predictor.json`: {"max_context": int, "tokenizer": folder or Hub id, "clip": float}. A relative
"tokenizer" path is resolved against the predictor folder, so the run folder can be moved as a whole.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .fileio import read_json_object, write_json

PREDICTOR_INFO_NAME = "kronos_predictor.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
DEFAULT_MAX_CONTEXT = 512  # the window of the published Kronos-small / Kronos-base


def write_predictor_info(folder: str | os.PathLike, *, max_context: int, tokenizer: str | os.PathLike | None = None,
                         clip: float | None = None) -> Path:
    """Write `kronos_predictor.json` into a predictor folder (atomically).

    Parameters
    ----------
    folder: the predictor folder (e.g. a stage's best_model/).
    max_context: the predictor window used in training (lookback + predict) - what forecasting should use.
    tokenizer: the tokenizer the predictor was trained with (folder or Hub id). A folder is stored relative to
        `folder` when it lies under the same parent tree, so moving the run keeps it valid.
    clip: the normalisation clip used in training.

    Returns
    -------
    The written file's path.
    """
    return write_json(Path(folder) / PREDICTOR_INFO_NAME,
                      predictor_info(folder, max_context=max_context, tokenizer=tokenizer, clip=clip))


def predictor_info(folder: str | os.PathLike, *, max_context: int, tokenizer: str | os.PathLike | None = None,
                   clip: float | None = None) -> dict[str, Any]:
    """The content of `kronos_predictor.json` for a predictor that will live in `folder` (arguments as in
    `write_predictor_info`); a tokenizer folder is made relative to `folder`."""
    if not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 1:
        raise ValueError(f"max_context must be an integer >= 1, got {max_context!r}")
    folder = Path(folder)
    info: dict[str, Any] = {"max_context": max_context}
    if tokenizer is not None:
        tok = Path(tokenizer)
        if tok.exists():
            try:
                tokenizer = os.path.relpath(tok.resolve(), folder.resolve())
            except ValueError:  # another drive (Windows): keep it absolute
                tokenizer = str(tok.resolve())
        info["tokenizer"] = str(tokenizer)
    if clip is not None:
        info["clip"] = float(clip)
    return info


def read_predictor_info(folder: Path) -> dict[str, Any]:
    """`kronos_predictor.json` checked ({} when absent): max_context int >= 1, tokenizer str, clip > 0."""
    path = folder / PREDICTOR_INFO_NAME
    if not path.is_file():
        return {}
    info = read_json_object(path)
    mc = info.get("max_context")
    if mc is not None and (not isinstance(mc, int) or isinstance(mc, bool) or not 1 <= mc <= 1_000_000):
        raise ValueError(f"{path}: max_context must be an integer in [1, 1000000], got {mc!r}")
    if "tokenizer" in info and not isinstance(info["tokenizer"], str):
        raise ValueError(f"{path}: tokenizer must be a folder path or Hub id (a string), got {info['tokenizer']!r}")
    clip = info.get("clip")
    if clip is not None and (not isinstance(clip, (int, float)) or isinstance(clip, bool) or not clip > 0):
        raise ValueError(f"{path}: clip must be a number > 0, got {clip!r}")
    return info


def tokenizer_source(folder: Path, info: dict[str, Any]) -> str | None:
    """The tokenizer recorded in `info` as a loadable source (relative folders resolved against `folder`)."""
    tok = info.get("tokenizer")
    if tok is None:
        return None
    candidate = folder / tok
    return str(candidate) if candidate.is_dir() else tok


def read_tokenizer_config(folder: Path) -> dict[str, Any] | None:
    """The predictor folder's `tokenizer_config.json` (the tokenizer it was trained with), or None."""
    path = folder / TOKENIZER_CONFIG_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
