"""Checkpoint files: the resumable `last.pt` (one dict, written atomically) and the published-format best model.

Only rank 0 calls the writers here; the training loop puts a `barrier()` after them before any rank reads.
Writes go to a temporary name in the same folder and are moved into place with `os.replace`, so a process killed
mid-write leaves the previous checkpoint intact, never half a file.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.hub import atomic_write

__all__ = [
    "CHECKPOINT_FORMAT",
    "last_checkpoint_path",
    "find_resume_checkpoint",
    "atomic_torch_save",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "save_pretrained_atomic",
    "write_json_atomic",
]

CHECKPOINT_FORMAT = "kronos-finetune/last-v1"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def last_checkpoint_path(output_dir: str | Path) -> Path:
    """Where the loop keeps its resumable checkpoint: `<output_dir>/checkpoints/last.pt`."""
    return Path(output_dir) / "checkpoints" / "last.pt"


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> Path | None:
    """Decide what to resume from (`training.resume`).

    "auto": `<output_dir>/checkpoints/last.pt` if it exists, else start fresh; "never" (or ""): start fresh;
    anything else is a path to a last.pt (or to a folder holding checkpoints/last.pt), which must exist.
    """
    key = (resume or "never").strip()
    if key.lower() in ("never", "no", "false", "none"):
        return None
    if key.lower() == "auto":
        path = last_checkpoint_path(output_dir)
        return path if path.is_file() else None
    path = Path(key)
    if path.is_dir():
        path = last_checkpoint_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training.resume: checkpoint {key} not found (use 'auto', 'never' or a last.pt path)")
    return path


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """`torch.save(obj)` to a temporary file beside `path`, then `os.replace` it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def write_json_atomic(data: Any, path: str | Path) -> Path:
    """Write `data` as indented JSON (NaN/inf as null) to `path` via a temporary file and `os.replace`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_strict(data), indent=2, default=str) + "\n"
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _strict(data: Any) -> Any:
    """NaN/inf floats -> None, so the file is strict JSON (json.dump would write the non-standard NaN/Infinity)."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _strict(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_strict(v) for v in data]
    return data


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Load a `last.pt` written by the loop (tensors, numbers, strings only: `weights_only=True` is safe)."""
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a training checkpoint of this project (format {CHECKPOINT_FORMAT})")
    return state


def rng_state() -> dict:
    """RNG states of python, numpy, torch CPU and (if present) CUDA, as plain lists/tensors."""
    py = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_pretrained_atomic(model: Any, folder: str | Path, extra_json: dict[str, Any] | None = None) -> Path:
    """`model.save_pretrained(folder)` (config.json + model.safetensors) plus `extra_json` files, swapped in whole.

    The folder is written under a temporary name and renamed into place, so a reader never sees a mix of an old
    config and new weights. `extra_json` maps file names to JSON-able data, e.g. {"tokenizer_config.json": {...}}.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes an owner-only folder
        model.save_pretrained(str(tmp))
        for name, data in (extra_json or {}).items():
            write_json_atomic(data, tmp / name)
        old = folder.with_name(f".{folder.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def load_pretrained(cls: Any, source: str | Path, key: str) -> Any:
    """`cls.from_pretrained(source)` (a published-format folder or Hub id), failing with a ValueError that names
    the YAML key to change."""
    try:
        return cls.from_pretrained(source)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        raise ValueError(f"{key}: cannot load {cls.__name__} from '{source}': {e}\n  set {key} to a folder with "
                         "config.json + model.safetensors (or a Hub id)") from e


def check_token_sizes(tokenizer: Any, predictor: Any, keys: str) -> None:
    """The predictor's vocabularies must match the tokenizer's sub-token bits (else ids index out of range);
    `keys` names the settings that chose the pair."""
    if (tokenizer.s1_bits, tokenizer.s2_bits) != (predictor.s1_bits, predictor.s2_bits):
        raise ValueError(
            f"{keys}: the tokenizer has s1/s2 bits {tokenizer.s1_bits}/{tokenizer.s2_bits} but the predictor "
            f"expects {predictor.s1_bits}/{predictor.s2_bits}; use a matching pair")
