"""What a stage folder holds and what a new run does with it: resume, skip, overwrite or refuse.

    status = stage_status(out)              # "empty" | "unfinished" | "finished"  (for --skip-existing)
    plan = plan_run(out, cfg)               # rank 0, while holding the folder's RunLock

The rules (issue 8, observation 1):
- "finished" is recorded explicitly: `run_info.json` gets `"finished": true` (and the final checkpoint's loop state
  `finished`) only when the loop ran out of epochs or stopped early. A best_model/ from epoch 1 of an interrupted
  run is "unfinished".
- unfinished + training.resume=auto -> resume from the newest usable checkpoint (one line saying so); with no
  checkpoint at all (killed before the first save) it starts over.
- finished -> skipped (the result is read back from the final checkpoint), unless training.overwrite=true, which
  deletes the old outputs (named in one line) - only after the new run holds the lock.
- training.resume=never on a folder holding a run is an error pointing at training.overwrite;
  training.resume=required with nothing to resume is an error.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..errors import RefusedError
from .checkpoint_store import LAST_NAME, list_checkpoints

__all__ = ["RUN_OUTPUTS", "RunPlan", "StageFolderError", "stage_status", "plan_run", "remove_outputs",
           "data_fingerprint", "weights_fingerprint", "describe_changes"]

RUN_OUTPUTS = ("checkpoints", "best_model", "metrics.jsonl", "loss_curve.png", "run_info.json", "tensorboard")
"""What a run writes into its stage folder (what training.overwrite deletes); nothing else is touched."""

Status = Literal["empty", "unfinished", "finished"]


class StageFolderError(RefusedError, ValueError):
    """The stage folder's content and training.resume / training.overwrite disagree (a user decision is needed)."""


def _read_run_info(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "run_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _has_checkpoint(folder: Path) -> bool:
    ckpt = folder / "checkpoints"
    return bool(list_checkpoints(ckpt)) or (ckpt / LAST_NAME).is_file()


def stage_status(folder: str | Path) -> Status:
    """"finished" when run_info.json records a finished run, "unfinished" when the folder holds any run output
    (a checkpoint, best_model/, metrics.jsonl, run_info.json), else "empty" (also for a missing folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "empty"
    info = _read_run_info(folder)
    if (info.get("result") or {}).get("finished") is True and _has_checkpoint(folder):
        return "finished"
    if _has_checkpoint(folder) or any((folder / name).exists() for name in RUN_OUTPUTS):
        return "unfinished"
    return "empty"


@dataclass(frozen=True)
class RunPlan:
    """What rank 0 decided to do with the stage folder (broadcast to every rank)."""

    action: Literal["fresh", "resume", "skip"]
    """fresh = train from the start; resume = continue from `checkpoint_dir`/`checkpoint`; skip = finished."""
    checkpoint: str | None = None
    """An explicit checkpoint file to resume from (training.resume=<path>), else None (use the newest)."""
    checkpoint_dir: str | None = None
    """The folder whose newest usable checkpoint is resumed (or read back when skipping)."""
    message: str = ""
    """The one line to log about the decision ('' = nothing to say)."""
    remove: tuple[str, ...] = ()
    """Old outputs to delete before training (training.overwrite)."""


def plan_run(folder: str | Path, resume: str, overwrite: bool, stage: str) -> RunPlan:
    """Decide what a run does with `folder` given training.resume and training.overwrite (pure, reads only).

    Parameters
    ----------
    folder: the stage's output folder.
    resume: training.resume: 'auto', 'never', 'required' or a path to a checkpoint file / run folder.
    overwrite: training.overwrite.
    stage: the stage name, for the messages.

    Returns
    -------
    The `RunPlan`; raises `StageFolderError` when the settings contradict the folder's content.
    """
    folder = Path(folder)
    status = stage_status(folder)
    key = (resume or "never").strip()
    mode = key.lower()
    present = [name for name in RUN_OUTPUTS if (folder / name).exists()]
    if overwrite:
        if status == "empty":
            return RunPlan("fresh")
        return RunPlan("fresh", remove=tuple(present),
                       message=f"[{stage}] training.overwrite=true: replacing the {status} run in {folder} "
                               f"(deleting {', '.join(present)})")
    if mode in ("never", "no", "false", "none", ""):
        if status != "empty":
            raise StageFolderError(
                f"training.resume=never but {folder} already holds a{'' if status == 'unfinished' else ' finished'} "
                f"{stage} run ({', '.join(present)}); set training.overwrite=true (--overwrite) to replace it, "
                "training.resume=auto to continue it, or use another output folder")
        return RunPlan("fresh")
    if mode in ("auto", "required"):
        if status == "finished":
            return RunPlan("skip", checkpoint_dir=str(folder / "checkpoints"),
                           message=f"[{stage}] {folder} already holds a finished run; skipping it "
                                   "(--overwrite or training.overwrite=true trains it again)")
        if _has_checkpoint(folder):
            return RunPlan("resume", checkpoint_dir=str(folder / "checkpoints"),
                           message=f"[{stage}] {folder} holds an unfinished run: resuming it "
                                   "(--overwrite starts over instead)")
        if mode == "required":
            raise StageFolderError(f"training.resume=required but {folder} holds no checkpoint to resume; "
                                   "set training.resume=auto to start a new run")
        if status == "unfinished":
            return RunPlan("fresh", remove=tuple(present),
                           message=f"[{stage}] {folder} holds outputs of a run killed before its first checkpoint "
                                   f"({', '.join(present)}); starting over")
        return RunPlan("fresh")
    path = Path(key)
    if path.is_dir():
        path = path / "checkpoints" / LAST_NAME if (path / "checkpoints").is_dir() else path / LAST_NAME
    if not path.is_file():
        raise StageFolderError(f"training.resume: checkpoint {key} not found "
                               "(use 'auto', 'never', 'required' or a checkpoint file / run folder)")
    if status != "empty" and path.parent.resolve() != (folder / "checkpoints").resolve():
        raise StageFolderError(f"training.resume={key} resumes another run, but {folder} already holds a {status} "
                               f"run ({', '.join(present)}); set training.overwrite=true (--overwrite) to replace "
                               "it, or use another output folder")
    return RunPlan("resume", checkpoint=str(path), message=f"[{stage}] resuming from {path}")


def remove_outputs(folder: str | Path, names: tuple[str, ...]) -> None:
    """Delete the run outputs `names` (from RUN_OUTPUTS) in `folder`; call it only while holding the run lock."""
    folder = Path(folder)
    for name in names:
        if name not in RUN_OUTPUTS:
            raise ValueError(f"{name} is not a run output")
        p = folder / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))


def data_fingerprint(data_info: dict[str, Any] | None) -> str | None:
    """sha256 of `data_info` as canonical JSON (None without data_info)."""
    return None if data_info is None else hashlib.sha256(_canonical(data_info).encode()).hexdigest()


def weights_fingerprint(module: nn.Module) -> str:
    """sha256 over a module's state dict (names, dtypes, shapes and bytes, in name order)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out or {prefix: []}
    return {prefix: obj}


def describe_changes(old: dict[str, Any] | None, new: dict[str, Any] | None, limit: int = 8) -> list[str]:
    """'key: old -> new' for each differing leaf of two nested dicts (data_info), at most `limit` plus a count."""
    a, b = _flatten(old or {}), _flatten(new or {})
    diffs = [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in sorted(set(a) | set(b))
             if a.get(k, "(absent)") != b.get(k, "(absent)")]
    return diffs[:limit] + ([f"... and {len(diffs) - limit} more"] if len(diffs) > limit else [])
