"""Checkpoints, in one place: what a resumable checkpoint holds (`Checkpoint`, format `CHECKPOINT_FORMAT`), writing
it atomically with rotation (rank 0 only) and reading it back (`load_latest`, falling back past a broken newest
file). The write and read guarantees: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch

from finetune.utils.errors import CheckpointError, CheckpointWriteError, NonFiniteWeightsError
from model.fileio import SEAL_NAME, atomic_write, disk_full, exception_chain

CHECKPOINT_FORMAT = "kronos-finetune/last-v1"
LAST_NAME = "last.pt"


class Checkpoint(TypedDict):
    """What a resumable checkpoint (`checkpoints/step-XXXXXXXX.pt`, `last.pt`) holds: tensors, numbers, strings,
    lists and dicts only, so it loads with `torch.load(weights_only=True)`. `Trainer.state_dict()` builds it,
    `Trainer.load_state_dict()` continues from it."""

    format: str  # CHECKPOINT_FORMAT
    stage: str  # "tokenizer" | "predictor"
    model: dict[str, torch.Tensor]  # the unwrapped model's state_dict
    model_args: dict[str, Any]  # its constructor arguments (a resume with other shapes is refused)
    optimizer: dict[str, Any]  # AdamW state_dict (moments, step counts)
    scheduler: dict[str, Any]  # OneCycleLR state_dict (last_epoch = optimizer steps done)
    loop: dict[str, Any]  # dataclasses.asdict(training_utils.LoopState)
    rng: list[dict[str, Any]]  # `rng_state()` of every rank, by rank
    world_size: int
    training_config: dict[str, Any]  # the stage's TrainingConfig (RESUME_KEYS may not change on resume)
    run_config: dict[str, Any]  # the pipeline's whole resolved config
    data_info: dict[str, Any] | None  # what defines the data, and its `data_fingerprint`
    data_fingerprint: str | None
    frozen_fingerprint: str | None  # `weights_fingerprint` of the frozen tokenizer (predictor stage)
    start_fingerprint: str | None  # `weights_fingerprint` of the model before its first step; absent before
    threads: int  # torch's intra-op threads (a resume uses as many: CPU sums depend on it); absent before
    window: dict[str, Any] | None  # the training windows' lookback, predict, clip (data.*); absent before


def check_format(state: dict) -> None:
    """A `load_latest` validate hook: the dict must be a training checkpoint of this format (ValueError if not)."""
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"not a training checkpoint of this project (format {state.get('format')!r}, "
                         f"expected {CHECKPOINT_FORMAT})")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Load one checkpoint file the user named; an unusable file is a CheckpointError naming it and why.
    `map_location` is where the model and optimizer tensors go (the training device); RNG states stay on the CPU."""
    reason, state = _unreadable_reason(Path(path), map_location, check_format)
    if reason is not None:
        raise CheckpointError(f"training.resume: cannot resume from {path}: {reason}")
    return state


def rng_state() -> dict:
    """RNG states of python, numpy, torch CPU and (if present) CUDA, as plain lists/tensors."""
    py = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


_STEP_RE = re.compile(r"^step-(\d{8,})\.pt$")
# best_model/'s temporary folders (atomic_dir): tempfile.mkdtemp(prefix=".<name>.") adds 8 chars; ".<name>.old".
_MODEL_TMP_RE = re.compile(r"^\.(?P<name>.+)\.(old|[a-z0-9_]{8})$")
_MODEL_FILES = {"config.json", "model.safetensors", "tokenizer_config.json", "kronos_predictor.json",
                "run_info.json", "adapter", "tokenizer", SEAL_NAME}  # adapter/: lora; tokenizer/: its copy
_OLD_MODEL_RE = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.old$")  # model.fileio.atomic_dir's old folder
_OVERHEAD = 64 * 1024  # zip headers + pickled structure beyond the raw tensor bytes
_log = logging.getLogger(__name__)


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """The step files in `folder` as (step, path), newest (highest step) first; [] when there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_file()]
    return sorted(found, reverse=True)


def estimate_bytes(state: Any) -> int:
    """Bytes `torch.save(state)` needs, estimated from the tensors' sizes (plus a small fixed overhead)."""
    return sum(t.numel() * t.element_size() for _, t in _tensors(state)) + _OVERHEAD


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def space_error(path: str | Path, needed: int, cause: BaseException | None = None,
                key: str = "training.output_dir") -> CheckpointWriteError:
    """The `CheckpointWriteError` for a failed write of about `needed` bytes to `path` (names free space and the
    setting `key` that moves the output)."""
    path = Path(path)
    free = _free_bytes(path.parent)
    free_text = _human(free) if free is not None else "unknown"
    code = next((e.errno for e in exception_chain(cause) if isinstance(e, OSError) and e.errno is not None), None)
    if code is not None:
        reason = os.strerror(code).lower()
    elif cause is not None:
        reason = "the write failed (disk full, file too large or a disk error)"
    else:
        reason = "not enough free space"
    error = CheckpointWriteError(
        errno.ENOSPC, f"cannot write checkpoint {path}: {reason}; {free_text} free on that disk, about "
        f"{_human(needed)} needed. Free some space or set {key} to a folder on a larger disk", str(path))
    error.needed = needed  # so a caller that knows the pipeline's settings key can name it (space_error again)
    return error


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems do not fsync folders; the rename itself is still atomic
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _save_to(state: Any, tmp: str) -> None:
    # Through an open file object: torch then reports a failed write (EFBIG, ENOSPC) with the OSError attached.
    with open(tmp, "wb") as f:
        torch.save(state, f)


@contextlib.contextmanager
def full_disk_named(path: Path, needed: int) -> Iterator[None]:
    """A full disk (or file-size limit) in the block becomes the CheckpointWriteError of writing `needed` bytes
    to `path`."""
    try:
        yield
    except BaseException as e:  # OSError, or safetensors' SafetensorError (not an OSError) on a full disk
        if disk_full(e):
            raise space_error(path, needed, e) from e
        raise


def _point_last(path: Path, needed: int) -> Path:
    """Make `last.pt` the newest checkpoint: a hard link to `path` (atomic via a temporary link), else a copy."""
    last = path.parent / LAST_NAME
    tmp = path.parent / f".{LAST_NAME}.{secrets.token_hex(4)}.tmp"
    with full_disk_named(last, needed):
        try:
            try:
                os.link(path, tmp)
            except OSError as e:
                if disk_full(e):
                    raise
                shutil.copyfile(path, tmp)  # no hard links here (some network/FUSE filesystems)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, last)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return last


def save(state: Any, folder: str | Path, step: int, *, keep: int = 2, log: Callable[[str], None] | None = None,
         write: bool = True) -> Path | None:
    """Write `state` (tensors on any device; or an object, e.g. the trainer, whose state_dict() gives them: every
    rank calls it then, as state_dict() may gather, and only `write` (rank 0) writes, the others get None) as
    `<folder>/step-XXXXXXXX.pt` atomically, point `last.pt` at it and return its path; older step files beyond the
    newest `keep` are deleted once the new one is in place. A state with NaN/inf tensors is refused
    (NonFiniteWeightsError); `log` (default: this module's logger) gets the line about deleted later-step files."""
    if keep < 1:
        raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
    if not isinstance(state, dict):  # a stateful object (torchtitan's Stateful protocol: importing it costs seconds)
        state = state.state_dict()
    if not write:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{int(step):08d}.pt"  # 8 digits, more when the step needs them: names sort by step
    assert_finite_state_dict(state, str(path))
    needed = estimate_bytes(state)
    free = _free_bytes(folder)
    if free is not None and free < needed:
        raise space_error(path, needed, None)
    with full_disk_named(path, needed):  # torch.save through the project's one atomic writer
        atomic_write(path, lambda tmp: _save_to(state, tmp))
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
    try:  # torch.load skips the zip's CRC-32s: a flipped bit inside a tensor would load silently
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except Exception:  # noqa: BLE001 - not a zip (garbage, a legacy file): torch.load below says what it is
        bad = None
    if bad is not None:
        return f"damaged: its record {bad} fails its CRC-32 check (a flipped bit or a partial overwrite)", None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
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
    if torch.device(map_location).type != "cpu":
        state.update({key: _to_device(state[key], map_location) for key in _ON_DEVICE if key in state})
    return None, state


# The checkpoint fields that go to the training device. The rest stays on the CPU: the RNG states must (numpy reads
# host memory; torch's generators, CUDA's included, take CPU ByteTensors), the counters and settings need no device.
_ON_DEVICE = ("model", "optimizer")


def _to_device(obj: Any, device: Any) -> Any:
    """`obj` (tensors inside nested dicts/lists) with every tensor moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def load_latest(folder: str | Path, *, map_location: Any = "cpu", validate: Callable[[dict], None] | None = None,
                log: Callable[[str], None] | None = None) -> tuple[Path, dict] | None:
    """(path, state) of the newest usable checkpoint in `folder`, falling back to older ones; None when there is
    no checkpoint file, `CheckpointError` when files exist but none can be used. `validate` checks a loaded dict
    (e.g. its format tag; a ValueError makes the file unusable); `log` (default: this module's logger at WARNING)
    gets a line per unusable file. `map_location`: as in `load_checkpoint`."""
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


def _only_model_files(p: Path, tmp_ok: bool = False) -> bool:
    """`p` is a folder of published-model files only (`tmp_ok`: and hidden `.tmp` files of a killed write)."""
    tmp = lambda n: tmp_ok and n.startswith(".") and n.endswith(".tmp")  # noqa: E731
    return p.is_dir() and all(c.name in _MODEL_FILES or tmp(c.name) for c in p.iterdir())


def remove_orphans(folder: str | Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """Delete what killed writes left in `folder` (not recursive; call it under the folder's run lock); returns them.

    Removed: hidden `.*.tmp` files and folders, and `.<name>.<8 chars>` / `.<name>.old` folders that hold only
    published-model files (config.json, model.safetensors, tokenizer_config.json). Nothing else is touched.
    A `.<name>.<8 chars>.old/x` model folder of a swap killed half-way is moved back to `<name>` when that is
    missing (model.fileio.atomic_dir without renameat2), else removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for p in sorted(folder.iterdir()):
        if (m := _OLD_MODEL_RE.match(p.name)) and _only_model_files(p / "x"):
            if not (folder / m.group("name")).exists():  # killed mid-swap: the old model is the only one left
                os.replace(p / "x", folder / m.group("name"))
                (log or _log.warning)(f"{folder / m.group('name')}: restored from an interrupted swap")
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            continue
        orphan_tmp = p.name.startswith(".") and p.name.endswith(".tmp") and len(p.name) > len(".tmp") + 1
        if not (orphan_tmp or (_MODEL_TMP_RE.match(p.name) and _only_model_files(p, tmp_ok=True))):
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


def prepare_folder(folder: str | Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """Open a checkpoint (or stage) folder for writing: create it and `remove_orphans`; rank 0, under the run lock."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    return remove_orphans(folder, log=log)


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of every tensor inside nested dicts/lists, in insertion order."""
    if isinstance(obj, torch.Tensor):
        yield prefix or "<tensor>", obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]" if prefix else f"[{i}]")


def assert_finite_state_dict(state_dict: Any, what: str) -> None:
    """Raise `NonFiniteWeightsError` naming the first tensor of `state_dict` (a model state dict or a whole
    checkpoint: nested dicts/lists are searched) that holds NaN/inf; call it before writing `what` (e.g.
    "checkpoints/step-00000123.pt", named in the message)."""
    named = [(name, t) for name, t in _tensors(state_dict) if t.is_floating_point() or t.is_complex()]
    if not named:
        return
    # One 0-d flag per tensor, copied to the CPU in one go per device (not one sync per tensor).
    flags: dict[int, bool] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        ok = torch.stack([torch.isfinite(named[i][1].detach()).all() for i in idx]).cpu()  # (len(idx),) bool
        flags.update(zip(idx, ok.tolist()))
    for i, (name, t) in enumerate(named):
        if flags[i]:
            continue
        t = t.detach()
        n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        kinds = ", ".join(k for k, n in (("NaN", n_nan), ("inf", n_inf)) if n)
        n_bad_tensors = sum(1 for ok in flags.values() if not ok)
        raise NonFiniteWeightsError(
            f"refusing to write {what}: tensor '{name}' holds {n_nan + n_inf} non-finite value(s) ({kinds}) of "
            f"{t.numel()} ({n_bad_tensors} tensor(s) affected); nothing was written, the previous checkpoint is kept")
