"""The trainer's run-safety steps before training: lock, folder decision, checkpoint choice, what a resume may change.

    value = on_main(fn, dist)                     # rank 0 computes, every rank gets the value or the same error
    path, saved = load_for_resume(plan, dist)     # newest usable checkpoint (rank 0 picks, all ranks load it)
    changes = check_data(saved, data_info, frozen_fp, accept)    # data / frozen tokenizer changed?
    restore_optimizer(optimizer, scheduler, saved)               # keeps this run's lr/betas/weight decay/schedule

Why rank 0 decides and broadcasts: the folder's content can change between two ranks' reads (rank 0 deletes
orphans and old outputs), and a rank that raised alone would leave the others hanging in the next collective.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..checkpoint import CHECKPOINT_FORMAT, load_checkpoint, rng_state, set_rng_state
from ..config_utils import ConfigError
from ..distributed import DistInfo, all_gather_object
from .checkpoint_store import load_latest
from .stage_folder import RunPlan, StageFolderError, data_fingerprint, describe_changes

__all__ = ["on_main", "load_for_resume", "check_data", "restore_optimizer", "rng_fork", "validate_format"]

T = TypeVar("T")


def on_main(fn: Callable[[], T], dist: DistInfo) -> T:
    """Run `fn` on rank 0 and hand its value to every rank; a ValueError/OSError it raises is raised on every rank
    (the original on rank 0, a `StageFolderError` with the same message elsewhere), so all ranks exit cleanly."""
    value, error = None, None
    if dist.is_main:
        try:
            value = fn()
        except (ValueError, OSError) as e:
            error = e
    shared = all_gather_object((value, None if error is None else str(error)))[0]
    if error is not None:
        raise error
    if shared[1] is not None:
        raise StageFolderError(shared[1])
    return shared[0]


def validate_format(state: dict) -> None:
    """A checkpoint_store `validate` hook: the dict must be a training checkpoint of this project."""
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"not a training checkpoint of this project (format {state.get('format')!r})")


def load_for_resume(plan: RunPlan, dist: DistInfo, log: Callable[[str], None]) -> tuple[Path, dict] | None:
    """The checkpoint `plan` resumes (or reads back, when skipping): an explicit file, else the newest usable one
    in `plan.checkpoint_dir` (a corrupt newest is reported by path and the previous one used). None: nothing."""

    def pick() -> str | None:
        if plan.checkpoint is not None:
            load_checkpoint(plan.checkpoint)  # an unusable explicit file is an error, not a silent fresh start
            return plan.checkpoint
        found = load_latest(plan.checkpoint_dir, validate=validate_format, log=log)
        return None if found is None else str(found[0])

    path = on_main(pick, dist)
    if path is None:
        return None
    return Path(path), load_checkpoint(path, map_location=dist.device)


def check_data(saved: dict, data_info: dict[str, Any] | None, frozen_fp: str | None, accept: bool,
               path: Path) -> list[str]:
    """Compare the checkpoint's data fingerprint and frozen-model hash with this run's.

    Returns the changes found (empty when none, or when the checkpoint predates fingerprints); raises a
    ConfigError naming them unless `accept` (training.accept_changed_data).
    """
    changes = []
    old_fp = saved.get("data_fingerprint")
    if old_fp is not None and old_fp != data_fingerprint(data_info):
        diff = describe_changes(saved.get("data_info"), data_info) or ["(the data description differs)"]
        changes.append("the training data changed: " + "; ".join(diff))
    old_frozen = saved.get("frozen_fingerprint")
    if old_frozen is not None and old_frozen != frozen_fp:
        changes.append(f"the frozen tokenizer's weights changed (sha256 {old_frozen[:12]} -> {str(frozen_fp)[:12]})")
    if changes and not accept:
        raise ConfigError([f"training.accept_changed_data: {c}; set it to true to resume anyway (recorded in "
                           "run_info.json), or training.overwrite=true to start over" for c in changes],
                          title=f"Cannot resume from {path}")
    return changes


def restore_optimizer(optimizer: torch.optim.Optimizer, scheduler: Any, saved: dict) -> None:
    """Load the checkpoint's optimizer moments and step count, keeping THIS run's optimisation settings.

    `optimizer.load_state_dict` would bring back the old lr/betas/weight_decay and OneCycle bounds; instead the
    freshly built groups' settings are kept and the freshly built schedule (this run's lr, pct_start, div factors)
    is moved to the checkpoint's step. With unchanged settings this gives the exact same lr as loading the
    scheduler's state (the same closed-form OneCycle formula at the same step).
    """
    keep = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved["optimizer"])
    for group, settings in zip(optimizer.param_groups, keep):
        group.update(settings)
    step = int(saved["scheduler"]["last_epoch"])
    scheduler.last_epoch = step
    scheduler._step_count = int(saved["scheduler"].get("_step_count", step + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # get_lr outside step() warns; it is the closed form here
        lrs = scheduler.get_lr() if step > 0 else [g["initial_lr"] for g in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


@contextlib.contextmanager
def rng_fork() -> Iterator[None]:
    """Run a block without moving this process's random streams (python, numpy, torch): epoch-0 validation and
    forecast metrics must not change the training's dropout / sampling."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)
