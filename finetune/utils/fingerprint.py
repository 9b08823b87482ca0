"""The one fingerprint of the project: what every reuse decision compares (the ledger's stage inputs, the data
store's sources and arrays, a walk-forward's folds, a Qlib source, a forecast's data), by content, never by place:
a file is its bytes, a model its weight and config files, the data its `data_info` without the paths in it, the
settings the resolved values that change what is trained (so a changed code default counts). A moved but
identical input is the same input."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.utils.config_utils import config_to_dict, plain
from finetune.utils.schema import RESUME_CLASS
from model.fileio import sha256_file

PLACE_KEYS = frozenset({"path", "store_dir", "qlib_data_path", "dataset_path"})  # where, not what

_cache: dict[tuple, str] = {}  # (file, size, mtime_ns, ctime_ns, inode) -> sha256: one read per file and process


def file_fingerprint(path: str | Path, with_hash: bool = True) -> dict:
    """{"path" (resolved: where it was read), "bytes", "mtime_ns", "sha256" (None without `with_hash`)}."""
    p = Path(path)
    st = p.stat()
    return {"path": str(p.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": sha256_file(p) if with_hash else None}


def digest(value: Any) -> str:
    """sha256 of `value` (plain data) as canonical JSON: equal values, equal digests."""
    text = json.dumps(plain(value), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def without_places(value: Any) -> Any:
    """`value` with every key of PLACE_KEYS removed, at any depth: what identifies it wherever it lies."""
    if isinstance(value, dict):
        return {k: without_places(v) for k, v in value.items() if k not in PLACE_KEYS}
    if isinstance(value, (list, tuple)):
        return [without_places(v) for v in value]
    return value


def data_fingerprint(data_info: dict[str, Any] | None) -> str | None:
    """The digest of what defines the data (`data_info`: file sha256s, splits, window) without its paths; None
    without data_info."""
    return None if data_info is None else digest(without_places(data_info))


def tree_sha256(folder: str | Path, keep: Callable[[str], bool] = lambda name: True) -> str:
    """sha256 over the relative names and the sha256 of every file under `folder` (hidden ones aside) whose
    relative name `keep` accepts. A file's hash is cached by (path, size, mtime, ctime, inode): an unchanged model or
    data store is read once per process, and any write (also one that restores the mtime) changes its ctime."""
    folder, h = Path(folder), hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file() and not q.name.startswith(".")
                    and keep(q.relative_to(folder).as_posix())):
        st = p.stat()
        key = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        if key not in _cache:
            _cache[key] = sha256_file(p)
        h.update(f"{p.relative_to(folder).as_posix()}\0{_cache[key]}\n".encode())
    return h.hexdigest()


def model_fingerprint(source: str | os.PathLike | None) -> str | None:
    """The content of a starting model (`model.pretrained_*`: a save_pretrained folder or a Hub id, read from its
    local snapshot); None for a model built from scratch (its seed and architecture are settings)."""
    if source is None:
        return None
    from model.hub import resolve_model_dir

    return tree_sha256(resolve_model_dir(source))


def training_settings(cfg: Any) -> dict[str, Any]:
    """The resolved settings a trained model depends on, from a pipeline config (`PipelineConfig`): data (without
    paths), the architectures, `training:` without the settings that do not matter (schema.RESUME_CLASS) and the
    stage sections. The starting models' content is `model_fingerprint`'s, not their names'."""
    d = config_to_dict(cfg)
    model = {k: v for k, v in d["model"].items() if k not in ("pretrained_tokenizer", "pretrained_predictor",
                                                               "pretraining_cutoff")}
    training = {k: v for k, v in d["training"].items() if RESUME_CLASS.get(k) != "irrelevant"}
    return {"data": without_places(d["data"]), "model": model, "training": training,
            **{f"{s}_training": d[f"{s}_training"] for s in ("tokenizer", "predictor")}}


def forecast_settings(cfg: Any) -> dict[str, Any]:
    """The settings a forecast of a trained model depends on (`forecast:`)."""
    return config_to_dict(cfg)["forecast"]
