"""Checkpoint files: the resumable `last.pt` (one dict, written atomically) and the published-format best model.

Only rank 0 calls the writers here; the training loop puts a `barrier()` after them before any rank reads.
Writes go to a temporary name in the same folder and are moved into place with `os.replace`, so a process killed
mid-write leaves the previous checkpoint intact, never half a file.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.fileio import atomic_dir, write_json

__all__ = [
    "CHECKPOINT_FORMAT",
    "last_checkpoint_path",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "save_pretrained_atomic",
]

CHECKPOINT_FORMAT = "kronos-finetune/last-v1"


def last_checkpoint_path(output_dir: str | Path) -> Path:
    """Where the loop keeps its resumable checkpoint: `<output_dir>/checkpoints/last.pt`."""
    return Path(output_dir) / "checkpoints" / "last.pt"


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

    The folder is written under a temporary name and renamed into place (model.fileio.atomic_dir), so a reader
    never sees a mix of an old config and new weights. `extra_json` maps file names to JSON-able data, e.g.
    {"tokenizer_config.json": {...}}.
    """
    with atomic_dir(folder) as tmp:
        model.save_pretrained(str(tmp))
        for name, data in (extra_json or {}).items():
            write_json(tmp / name, data)
    return Path(folder)


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
