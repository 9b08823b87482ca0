"""run_info.json: what a model was trained with and on, written into every output folder.

    write_run_info(out_dir, config=config_to_dict(cfg), data=data_info)

`data` comes from the pipeline, which knows its inputs; the suggested shape (any JSON-able dict is accepted) is
    {"files": [file_fingerprint(p) for p in csv_paths],
     "splits": {"train": {"rows": 81234, "windows": 80000, "start": "2019-01-02", "end": "2022-12-30"}, ...}}
"""

from __future__ import annotations

import datetime
import hashlib
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from model.fileio import write_json

__all__ = ["library_versions", "git_commit", "file_fingerprint", "sha256_file", "build_run_info", "write_run_info"]

_LIBRARIES = ("torch", "numpy", "pandas", "pyqlib", "safetensors", "pyyaml", "huggingface_hub", "matplotlib",
              "tensorboard", "mlflow")  # the last three: plot and trackers, so a run says which it used


def library_versions() -> dict[str, str | None]:
    """Python and library versions (None for a library that is not installed), plus CUDA when present."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda if torch.cuda.is_available() else None
    except ImportError:
        pass
    return out


def git_commit(path: str | Path | None = None) -> dict[str, Any] | None:
    """{"commit": sha, "dirty": bool} of the git checkout holding `path` (this package by default), else None."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where, capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(status.strip())} if sha else None


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (large data files never sit in memory whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def file_fingerprint(path: str | Path, with_hash: bool = True) -> dict[str, Any]:
    """{"path", "bytes", "sha256"} of one input file (sha256 None when `with_hash` is False)."""
    p = Path(path)
    return {
        "path": str(p.resolve()),
        "bytes": p.stat().st_size,
        "sha256": sha256_file(p) if with_hash else None,
    }


def build_run_info(config: Any, data: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict:
    """The run_info dict: time, command line, config, library versions, git commit, data, and `extra`."""
    info = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "config": config,
        "versions": library_versions(),
        "git": git_commit(),
        "data": data,
    }
    if extra:
        info.update(extra)
    return info


def write_run_info(
    folder: str | Path, config: Any, data: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
) -> Path:
    """Write `<folder>/run_info.json` atomically (rank 0 only: the caller guards it) and return its path."""
    return write_json(Path(folder) / "run_info.json", build_run_info(config, data, extra))
