"""Save and load models in the published format: a folder with `config.json` + `model.safetensors`.

`config.json` holds the constructor's keyword arguments; `model.safetensors` the state dict. A local path that does
not exist is an error (it never silently turns into a Hub lookup); only a bare `owner/name` id goes to the Hub.
"""
from __future__ import annotations

import inspect
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from safetensors.torch import load_file, save_file

from .fileio import atomic_write, write_json  # noqa: F401  (atomic_write: old import path, kept for callers)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

M = TypeVar("M", bound="PretrainedMixin")


def constructor_args(cls: type) -> tuple[list[str], list[str]]:
    """(all argument names, required argument names) of `cls.__init__`."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in params if p.default is inspect.Parameter.empty and p.name in names]
    return names, required


def resolve_model_dir(path_or_id: str | os.PathLike) -> Path:
    """A local folder, or a Hub snapshot for a bare `owner/name` id. Raises FileNotFoundError otherwise."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_id)
    if path.exists():
        raise FileNotFoundError(f"{text!r} is a file; expected a model folder with {CONFIG_NAME} and {WEIGHTS_NAME}")
    if not _HUB_ID.match(text) or text.startswith("."):
        raise FileNotFoundError(f"model path {text!r} does not exist (expected a folder with {CONFIG_NAME} and "
                                f"{WEIGHTS_NAME}, or a Hugging Face Hub id such as 'NeoQuasar/Kronos-small')")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(text, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME]))
    except Exception as exc:  # offline, unknown repo, no huggingface_hub: say what was tried
        raise FileNotFoundError(
            f"{text!r} is not a local folder and could not be fetched from the Hugging Face Hub ({exc}). "
            "Download the checkpoint folder and pass its path instead.") from exc


def read_config(model_dir: Path, cls: type) -> dict[str, Any]:
    """config.json as constructor kwargs; names every missing argument and drops unknown keys."""
    cfg_path = model_dir / CONFIG_NAME
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: a {cls.__name__} folder needs {CONFIG_NAME} (the "
                                f"constructor arguments) and {WEIGHTS_NAME}")
    with open(cfg_path) as f:
        config = json.load(f)
    names, required = constructor_args(cls)
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(f"{cfg_path} lacks constructor arguments of {cls.__name__}: {', '.join(missing)}")
    return {k: v for k, v in config.items() if k in names}


class PretrainedMixin:
    """`from_pretrained` / `save_pretrained` for an nn.Module whose constructor kwargs are recorded in `self.config`."""

    config: dict[str, Any]

    def _record_config(self, local_vars: dict[str, Any]) -> None:
        names, _ = constructor_args(type(self))
        self.config = {k: local_vars[k] for k in names}

    @classmethod
    def from_pretrained(cls: type[M], path_or_id: str | os.PathLike, map_location: str | torch.device = "cpu") -> M:
        """Build from `config.json` and load `model.safetensors` strictly (same keys and shapes as published)."""
        model_dir = resolve_model_dir(path_or_id)
        model = cls(**read_config(model_dir, cls))
        weights = model_dir / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} not found")
        state = load_file(str(weights), device=str(map_location))
        model.load_state_dict(state, strict=True)
        return model

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write config.json + model.safetensors into `save_directory` (each file replaced atomically)."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        atomic_write(out / WEIGHTS_NAME, lambda p: save_file(state, p, metadata={"format": "pt"}))
        write_json(out / CONFIG_NAME, self.config)
        return out
