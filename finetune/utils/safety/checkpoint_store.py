"""Rotating resumable checkpoints: atomic step files, `last.pt` as the newest, a broken file falls back to the previous.

The layout of a checkpoint folder (`<stage>/checkpoints/`):

    step-00000120.pt   an older checkpoint (kept: the newest `keep` step files, default 2)
    step-00000150.pt   the newest checkpoint
    last.pt            the newest again: a hard link to step-00000150.pt (no extra disk space), or a copy where the
                       filesystem has no hard links. It stays the name users and `training.resume` know.

The rules:
- `save(state, folder, step)` refuses non-finite tensors (nothing written), checks the free space against the
  tensors' size, writes `step-XXXXXXXX.pt` to a temporary file (`.step-XXXXXXXX.pt.<random>.tmp`), fsyncs it,
  `os.replace`s it into place, points `last.pt` at it the same way, and only then deletes older step files. A run
  killed at any moment leaves at least one complete checkpoint. Step files of a LATER step than the one saved belong
  to a history this run replaced (it resumed from an earlier checkpoint) and are deleted, so a later resume cannot
  pick them.
- Disk full / file too large / quota become a `CheckpointWriteError` (an OSError) naming the file, the free space and
  the bytes needed, instead of torch's `enforce fail at inline_container.cc`; the temporary file is removed.
- `load_latest(folder)` tries the step files newest first (then a `last.pt` that is not one of them, as written by
  older versions). Every load is `torch.load(weights_only=True)`: a checkpoint holds only tensors, numbers, strings
  and containers, and a file that needs more is reported as unsafe, never loaded. An empty, truncated or garbage
  file is reported by path with the reason and the previous checkpoint is used; if none is usable a
  `CheckpointError` lists them all.
- `prepare_folder(folder)` removes orphans of killed writes: hidden `.*.tmp` files and folders, and the temporary
  folders of `checkpoint.save_pretrained_atomic` (`.<name>.<8 random chars>` / `.<name>.old` holding only model
  files). Call it on rank 0 while holding the run lock (`run_lock.RunLock`): a live writer's temporary file would
  otherwise be deleted under it.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from finetune.utils.safety.guard import assert_finite_state_dict
from model.fileio import atomic_write

from ..errors import DataError, UserError

__all__ = [
    "LAST_NAME",
    "CheckpointError",
    "CheckpointWriteError",
    "estimate_bytes",
    "is_space_error",
    "space_error",
    "list_checkpoints",
    "load_latest",
    "prepare_folder",
    "remove_orphans",
    "save",
    "step_path",
]

LAST_NAME = "last.pt"
_STEP_RE = re.compile(r"^step-(\d{8,})\.pt$")
# save_pretrained_atomic's temporary folders: tempfile.mkdtemp(prefix=".<name>.") adds 8 chars; ".<name>.old".
_MODEL_TMP_RE = re.compile(r"^\.(?P<name>.+)\.(old|[a-z0-9_]{8})$")
_MODEL_FILES = {"config.json", "model.safetensors", "tokenizer_config.json"}
_SPACE_ERRNOS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
_OVERHEAD = 64 * 1024  # zip headers + pickled structure beyond the raw tensor bytes
_log = logging.getLogger(__name__)


class CheckpointError(DataError):
    """No checkpoint in a folder could be loaded; the message lists each file and why."""


class CheckpointWriteError(UserError, OSError):
    """A checkpoint could not be written for lack of space (or a file-size limit); names file, free and needed."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28] ...: 'path'" decoration
        return str(self.strerror)


def step_path(folder: str | Path, step: int) -> Path:
    """`<folder>/step-00000123.pt` (8 digits, more when the step needs them, so names sort by step)."""
    return Path(folder) / f"step-{int(step):08d}.pt"


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """The step files in `folder` as (step, path), newest (highest step) first; [] when there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_file()]
    return sorted(found, reverse=True)


def estimate_bytes(state: Any) -> int:
    """Bytes `torch.save(state)` needs, estimated from the tensors' sizes (plus a small fixed overhead)."""
    total = 0
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return total + _OVERHEAD


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _errno_in_chain(e: BaseException) -> int | None:
    """The errno of the first OSError in `e`'s cause/context chain (torch wraps the writer's OSError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        e = e.__cause__ or e.__context__
    return None


def _is_space_error(e: BaseException) -> bool:
    code = _errno_in_chain(e)
    if code is not None:
        return code in _SPACE_ERRNOS
    # torch's C++ zip writer reports a failed write as RuntimeError("[enforce fail at inline_container.cc...] ...
    # file write failed" / "unexpected pos ..."), sometimes without the OSError behind it.
    return isinstance(e, RuntimeError) and ("inline_container" in str(e) or "PytorchStreamWriter" in str(e))


def _space_error(path: Path, needed: int, cause: BaseException | None) -> CheckpointWriteError:
    free = _free_bytes(path.parent)
    free_text = _human(free) if free is not None else "unknown"
    code = _errno_in_chain(cause) if cause is not None else None
    if code is not None:
        reason = os.strerror(code).lower()
    elif cause is not None:
        reason = "the write failed (disk full, file too large or a disk error)"
    else:
        reason = "not enough free space"
    return CheckpointWriteError(
        errno.ENOSPC,
        f"cannot write checkpoint {path}: {reason}; {free_text} free on that disk, about {_human(needed)} needed. "
        "Free some space or set training.output_dir to a folder on a larger disk",
        str(path),
    )


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not fsync folders; the rename itself is still atomic
    finally:
        os.close(fd)


def _tmp_name(folder: Path, name: str) -> Path:
    return folder / f".{name}.{secrets.token_hex(4)}.tmp"


def _save_to(state: Any, tmp: str) -> None:
    # Through an open file object: torch then reports a failed write (EFBIG, ENOSPC) with the OSError attached.
    with open(tmp, "wb") as f:
        torch.save(state, f)


def _write_file(state: Any, path: Path, needed: int) -> None:
    """torch.save through the project's one atomic writer (temporary file, fsync, rename; nothing left behind on
    failure); a full disk becomes CheckpointWriteError with the bytes this checkpoint needs."""
    try:
        atomic_write(path, lambda tmp: _save_to(state, tmp))
    except BaseException as e:
        if _is_space_error(e):
            raise _space_error(path, needed, e) from e
        raise


def _point_last(path: Path, needed: int) -> Path:
    """Make `last.pt` the newest checkpoint: a hard link to `path` (atomic via a temporary link), else a copy."""
    last = path.parent / LAST_NAME
    tmp = _tmp_name(path.parent, LAST_NAME)
    try:
        try:
            os.link(path, tmp)
        except OSError as e:
            if _is_space_error(e):
                raise
            shutil.copyfile(path, tmp)  # no hard links here (some network/FUSE filesystems)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, last)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if _is_space_error(e):
            raise _space_error(last, needed, e) from e
        raise
    return last


def save(state: dict, folder: str | Path, step: int, *, keep: int = 2, check_finite: bool = True,
         log: Callable[[str], None] | None = None) -> Path:
    """Write `state` as `<folder>/step-XXXXXXXX.pt` atomically, point `last.pt` at it, keep the newest `keep`.

    Parameters
    ----------
    state: the checkpoint dict (model, optimizer, scheduler, step, RNG states, config ...), tensors on any device.
    folder: the checkpoint folder (created if missing).
    step: the optimizer step the state is at (names the file; orders the rotation).
    keep: how many step files to keep (>= 1); older ones are deleted after the new one is in place.
    check_finite: refuse (NonFiniteWeightsError) to write a state with NaN/inf tensors.
    log: where the line about deleted later-step files goes (default: this module's logger).

    Returns
    -------
    The path of the step file written.
    """
    if keep < 1:
        raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = step_path(folder, step)
    if check_finite:
        assert_finite_state_dict(state, str(path))
    needed = estimate_bytes(state)
    free = _free_bytes(folder)
    if free is not None and free < needed:
        raise _space_error(path, needed, None)
    _write_file(state, path, needed)
    _fsync_dir(folder)
    _point_last(path, needed)
    _fsync_dir(folder)
    later = [p for s, p in list_checkpoints(folder) if s > step]
    if later:
        (log or _log.warning)(f"{folder}: deleting checkpoints of later steps from the history this run replaced: "
                              + ", ".join(p.name for p in later))
    older = [p for s, p in list_checkpoints(folder) if s < step]
    for p in later + older[keep - 1:]:
        p.unlink(missing_ok=True)
    return path


def _unreadable_reason(path: Path, map_location: Any, validate: Callable[[dict], None] | None
                       ) -> tuple[str | None, dict | None]:
    """(None, state) when `path` loads safely and passes `validate`, else (reason, None)."""
    try:
        size = path.stat().st_size
    except OSError as e:
        return f"cannot be read ({e.strerror})", None
    if size == 0:
        return "empty file (0 bytes): the write that made it was interrupted", None
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e).lower() or "weights only" in str(e).lower():
            return ("holds Python objects other than tensors, numbers and strings, so it cannot be loaded safely; "
                    "this trainer never writes such files (it comes from elsewhere or was altered)"), None
        return "not a torch checkpoint (garbage or another format)", None
    except Exception as e:  # noqa: BLE001 - garbage makes the unpickler fail in arbitrary ways (IndexError, KeyError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in first:  # never pass on torch's advice to load unsafely
            first = "unsafe content"
        if "zip" in first.lower() or "central directory" in first.lower() or isinstance(e, EOFError):
            return f"truncated or corrupt ({size} bytes; {first[:160]})", None
        return f"not a torch checkpoint ({first[:160]})", None
    if not isinstance(state, dict):
        return f"holds a {type(state).__name__}, not a checkpoint dict", None
    if validate is not None:
        try:
            validate(state)
        except ValueError as e:
            return str(e), None
    return None, state


def load_latest(folder: str | Path, *, map_location: Any = "cpu", validate: Callable[[dict], None] | None = None,
                log: Callable[[str], None] | None = None) -> tuple[Path, dict] | None:
    """The newest usable checkpoint in `folder`, falling back to older ones; None when there is none at all.

    Parameters
    ----------
    folder: the checkpoint folder.
    map_location: passed to `torch.load` (default "cpu").
    validate: optional check of a loaded dict (e.g. its format tag); a ValueError makes the file unusable.
    log: where the line about each unusable file goes (default: this module's logger at WARNING).

    Returns
    -------
    (path, state) of the checkpoint used, or None if the folder holds no checkpoint file.
    Raises `CheckpointError` when files exist but none can be used.
    """
    folder = Path(folder)
    candidates = [p for _, p in list_checkpoints(folder)]
    last = folder / LAST_NAME
    if last.is_file() and not any(os.path.samefile(last, p) for p in candidates):
        candidates.append(last)  # written by an older version, or a copy (no hard links): a last resort
    failures: list[str] = []
    for i, path in enumerate(candidates):
        reason, state = _unreadable_reason(path, map_location, validate)
        if reason is None:
            return path, state
        failures.append(f"{path}: {reason}")
        nxt = f"using the previous one, {candidates[i + 1].name}" if i + 1 < len(candidates) else "no older one left"
        (log or _log.warning)(f"checkpoint {path} is unusable: {reason}; {nxt}")
    if not candidates:
        return None
    raise CheckpointError("no usable checkpoint in " + str(folder) + ":\n  " + "\n  ".join(failures)
                          + "\n  Remove these files, or set training.overwrite=true to start over")


def _is_model_tmp_dir(p: Path) -> bool:
    m = _MODEL_TMP_RE.match(p.name)
    if not m or not p.is_dir():
        return False
    names = {c.name for c in p.iterdir()}
    return all(n in _MODEL_FILES or (n.startswith(".") and n.endswith(".tmp")) for n in names)


def remove_orphans(folder: str | Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """Delete what killed writes left in `folder` (not recursive); returns the removed paths.

    Removed: hidden `.*.tmp` files and folders, and `.<name>.<8 chars>` / `.<name>.old` folders that hold only
    published-model files (config.json, model.safetensors, tokenizer_config.json). Nothing else is touched.
    Only call it while holding the folder's run lock.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for p in sorted(folder.iterdir()):
        orphan_tmp = p.name.startswith(".") and p.name.endswith(".tmp") and len(p.name) > len(".tmp") + 1
        if not (orphan_tmp or _is_model_tmp_dir(p)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    if removed:
        (log or _log.warning)(f"{folder}: removed {len(removed)} leftover(s) of interrupted writes: "
                              + ", ".join(p.name for p in removed))
    return removed


def is_space_error(e: BaseException) -> bool:
    """True when `e` (or what it wraps) is a disk-full / file-too-large / quota error."""
    return _is_space_error(e)


def space_error(path: str | Path, needed: int, cause: BaseException | None = None) -> CheckpointWriteError:
    """The `CheckpointWriteError` for a failed write of about `needed` bytes to `path` (names free space)."""
    return _space_error(Path(path), needed, cause)


def prepare_folder(folder: str | Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """Open a checkpoint (or stage) folder for writing: create it and `remove_orphans`; rank 0, under the run lock."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    return remove_orphans(folder, log=log)
