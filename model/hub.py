"""Save and load models in the published format: a folder with `config.json` + `model.safetensors`.

`config.json` holds the constructor's keyword arguments; `model.safetensors` the state dict. A local path that does
not exist is an error (it never silently turns into a Hub lookup); only a bare `owner/name` id goes to the Hub,
through huggingface_hub's `snapshot_download` (cache, revision, token, offline mode as huggingface_hub defines them)."""
from __future__ import annotations

import hashlib
import inspect
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from model.config import DEFAULT_MAX_PARAMETERS
from model.errors import DataError, PathError
from model.fileio import atomic_write, check_seal, read_json_object, write_json

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

M = TypeVar("M", bound="PretrainedMixin")


def weights_fingerprint(weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """sha256 over a module's state dict, or over `weights` {name: tensor} (names, dtypes, shapes and bytes, in name
    order): what identifies the weights a model was trained with (a predictor's frozen tokenizer, recorded in
    kronos_predictor.json; the frozen base of a lora / freeze run)."""
    h = hashlib.sha256()
    tensors = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    for name, t in sorted(tensors.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def constructor_args(cls: type) -> tuple[list[str], list[str]]:
    """(all argument names, required argument names) of `cls.__init__`."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in params if p.default is inspect.Parameter.empty and p.name in names]
    return names, required


def is_hub_id(text: str) -> bool:
    """True for a bare `owner/name` that is not a local path (no leading '.', '/', '~')."""
    return bool(_HUB_ID.match(text)) and not text.startswith(".")


def resolve_model_dir(path_or_id: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                      revision: str | None = None, token: str | bool | None = None, local_files_only: bool = False,
                      force_download: bool = False, allow_patterns: list[str] | None = None) -> Path:
    """A local folder, or the Hub snapshot (`huggingface_hub.snapshot_download` of `allow_patterns`, default
    config.json + model.safetensors) of a bare `owner/name` id; PathError in one line when neither works."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_id)
    if path.exists():
        raise PathError(f"{text!r} is a file; expected a model folder with {CONFIG_NAME} and {WEIGHTS_NAME}")
    if not is_hub_id(text):
        raise PathError(f"model path {text!r} does not exist (expected a folder with {CONFIG_NAME} and "
                        f"{WEIGHTS_NAME}, or a Hugging Face Hub id such as 'NeoQuasar/Kronos-small')")
    from huggingface_hub import snapshot_download  # a core dependency, imported only when a Hub id is used

    try:
        folder = snapshot_download(text, revision=revision, cache_dir=cache_dir, token=token,
                                   local_files_only=local_files_only, force_download=force_download,
                                   allow_patterns=allow_patterns or [CONFIG_NAME, WEIGHTS_NAME])
    except Exception as exc:  # offline, unknown repo, gated, bad revision: one line says what was tried and why
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = f" at revision {revision!r}" if revision else ""
        raise PathError(
            f"{text!r} is not a local folder and could not be fetched from the Hugging Face Hub{where}: "
            f"{type(exc).__name__}: {reason}. Check the id (and token for a private repo), or download the "
            "checkpoint folder and pass its path instead.") from None
    return Path(folder)


def read_config(model_dir: Path, cls: type, max_parameters: float = DEFAULT_MAX_PARAMETERS) -> dict[str, Any]:
    """config.json as checked constructor kwargs (unknown keys dropped): a missing argument, a type or bound
    `cls.config_class` rejects, or more than `max_parameters` in all is a DataError naming the file and key (or the
    count), not an allocation of terabytes."""
    cfg_path = model_dir / CONFIG_NAME
    if not cfg_path.is_file():
        raise PathError(f"{cfg_path} not found: a {cls.__name__} folder needs {CONFIG_NAME} (the "
                        f"constructor arguments) and {WEIGHTS_NAME}")
    config = read_json_object(cfg_path, "a JSON object of constructor arguments")
    names, required = constructor_args(cls)
    missing = [k for k in required if k not in config]
    if missing:
        raise DataError(f"{cfg_path} lacks constructor arguments of {cls.__name__}: {', '.join(missing)}")
    kwargs = {k: v for k, v in config.items() if k in names}
    config_class = getattr(cls, "config_class", None)
    if config_class is not None:
        known = {f.name for f in fields(config_class)}
        problems = [(k, "must not be null") for k, v in kwargs.items() if v is None]
        checked = config_class(**{k: v for k, v in kwargs.items() if k in known and v is not None})
        problems += checked.problems()
        if problems:
            lines = "\n".join(f"  {key}: {msg}" for key, msg in problems)
            raise DataError(f"{cfg_path} has invalid {cls.__name__} settings:\n{lines}")
        count = checked.parameter_count()
        if count > max_parameters:
            raise DataError(f"{cfg_path} describes a {cls.__name__} of {count:,} parameters, above the limit of "
                            f"{int(max_parameters):,} (max_parameters= of from_pretrained); refusing to allocate it")
    return kwargs


def load_pretrained(cls: Any, source: str | os.PathLike, key: str) -> Any:
    """`cls.from_pretrained(source)` (a published-format folder or Hub id), failing with a PathError (nothing found)
    or DataError (found but unreadable) that names the setting `key` to change."""
    try:
        return cls.from_pretrained(source)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # PathError is a FileNotFoundError
        kind = PathError if isinstance(e, FileNotFoundError) else DataError
        raise kind(f"{key}: cannot load {cls.__name__} from '{source}': {e}\n  set {key} to a folder with "
                   "config.json + model.safetensors (or a Hub id)") from e


class PretrainedMixin:
    """`from_pretrained` / `save_pretrained` / `push_to_hub` for an nn.Module whose constructor kwargs are recorded
    in `self.config`. A subclass sets `config_class` (a `model.config` dataclass with `.problems()`)."""

    config: dict[str, Any]
    config_class: type | None = None

    def _record_config(self, local_vars: dict[str, Any]) -> None:
        names, _ = constructor_args(type(self))
        self.config = {k: local_vars[k] for k in names}

    @classmethod
    def from_pretrained(cls: type[M], path_or_id: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                        revision: str | None = None, token: str | bool | None = None, local_files_only: bool = False,
                        force_download: bool = False, map_location: str | torch.device = "cpu",
                        max_parameters: float = DEFAULT_MAX_PARAMETERS) -> M:
        """Build from `config.json` (checked first; more than `max_parameters` is refused before anything is
        allocated) and load `model.safetensors` strictly (published keys/shapes). The model is in training mode."""
        model_dir = resolve_model_dir(path_or_id, cache_dir=cache_dir, revision=revision, token=token,
                                      local_files_only=local_files_only, force_download=force_download)
        check_seal(model_dir, "train it again (training.overwrite=true) or copy the model again")
        kwargs = read_config(model_dir, cls, max_parameters)
        weights = model_dir / WEIGHTS_NAME
        if not weights.is_file():
            raise PathError(f"{weights} not found")
        model = cls(**kwargs)
        try:
            state = load_file(str(weights), device=str(map_location))
        except Exception as e:  # safetensors' own error (a Rust panic type for some damage): the file is damaged
            raise DataError(f"{weights}: not a readable safetensors file ({type(e).__name__}: {str(e)[:120]}); "
                            "copy or download the model again") from None
        bad = next((k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
        if bad is not None:
            raise DataError(f"{weights}: the weight {bad!r} holds NaN/inf; the model is damaged (copy or train it "
                            "again)")
        model.load_state_dict(state, strict=True)
        return model

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write config.json + model.safetensors into `save_directory` (each file replaced atomically); a weight
        holding NaN/inf is a DataError and nothing is written: non-finite weights never reach disk."""
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise DataError(f"refusing to save {type(self).__name__}: {len(bad)} tensors hold NaN/inf, first "
                            f"{bad[0]!r}")
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / WEIGHTS_NAME, lambda p: save_file(state, p, metadata={"format": "pt"}))
        write_json(out / CONFIG_NAME, self.config)
        return out

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, private: bool | None = None,
                    token: str | bool | None = None, revision: str | None = None, create_pr: bool = False) -> Any:
        """Upload config.json + model.safetensors to the Hub repo `repo_id` (created if needed) -> the commit info."""
        from huggingface_hub import HfApi

        if not is_hub_id(repo_id):
            raise DataError(f"repo_id must look like 'owner/name', got {repo_id!r}")
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return api.upload_folder(repo_id=repo_id, folder_path=tmp, repo_type="model", revision=revision,
                                     commit_message=commit_message or f"Upload {type(self).__name__}",
                                     create_pr=create_pr)
