"""Atomic file and folder writes for the whole project (a reader sees the old version or the new one, never half),
strict JSON, and sealed artifact folders (`seal` / `check_seal`: SHA256SUMS). What each guarantees: docs/CONTRACTS.md,
"File formats: atomic writes and sealed folders"."""
from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from model.errors import DataError

# Disk full, file too large, over quota: the machine's state, reported as such (never as a bug).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC))


# Rust's io::Error as safetensors' SafetensorError prints it (no errno): `IoError(Os { code: 28, kind: StorageFull..`.
_RUST_FULL = re.compile(r"StorageFull|FileTooLarge|QuotaExceeded|(os error|code:) (28|27|122)\b")


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then the exceptions it was raised from or while handling (torch and numpy wrap the writer's OSError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` is a full disk, quota or file size limit: the first OSError with an errno in its chain has one
    of DISK_FULL_ERRNOS; before it, the text may say so without an errno: numpy's short write ('1 requested and 0
    written'), safetensors' Rust io::Error, torch's zip writer (a RuntimeError, sometimes without the OSError)."""
    for e in exception_chain(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno in DISK_FULL_ERRNOS
        text = str(e)
        if (isinstance(e, OSError) and " requested and " in text and text.endswith(" written")
                or _RUST_FULL.search(text)
                or isinstance(e, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text)):
            return True
    return False


def _umask() -> int:
    """The process umask (reading it means setting it; set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _free_text(folder: Path) -> str:
    """The free space of `folder`'s filesystem, for a disk-full message."""
    try:
        n = shutil.disk_usage(folder).free
    except OSError:
        return "unknown"
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def atomic_write(target: str | os.PathLike, write_fn: Callable[[str], Any]) -> Path:
    """Call `write_fn(tmp_path)` (e.g. `lambda p: torch.save(obj, p)`) on a temporary file beside `target` (whose
    folder must exist), fsync it, then rename it into place with the permissions `open()` would give.
    A full disk is an OSError naming `target`, the free space and the bytes written so far."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write_fn(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes owner-only files
        os.replace(tmp, target)
    except BaseException as exc:
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and disk_full(exc):
            raise OSError(exc.errno or errno.ENOSPC, f"no space left to write {target}: {_free_text(target.parent)} "
                          f"free on that filesystem, {written} bytes written before the failure; free some space or "
                          "write elsewhere") from None
        raise
    return target


SEAL_NAME = "SHA256SUMS"


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def seal(folder: str | os.PathLike) -> Path:
    """Write `folder`'s SHA256SUMS (atomically): one `<sha256>  <relative path>` line per file below it."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != SEAL_NAME and not p.name.startswith("."))
    text = "".join(f"{sha256_file(p)}  {p.relative_to(folder).as_posix()}\n" for p in files)
    return atomic_write(folder / SEAL_NAME, lambda t: Path(t).write_text(text, encoding="utf-8"))


def check_seal(folder: str | os.PathLike, fix: str = "write it again", skip: tuple[str, ...] = (),
               exact: bool = False) -> None:
    """A DataError naming the first file of `folder` whose bytes are not the ones its SHA256SUMS recorded when it
    was written (damaged or edited) or that is missing (`exact`: or that the seal does not list, as `seal` would);
    `fix` says what to do. No SHA256SUMS (an older version wrote the folder, or a Hub download): nothing to check."""
    folder = Path(folder)
    try:
        lines = (folder / SEAL_NAME).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        digest, _, name = line.partition("  ")
        if name in skip:  # rebuilt from the others (kronos report's page)
            continue
        path = folder / name
        if not path.is_file() or sha256_file(path) != digest:
            why = "is missing" if not path.is_file() else "is not the file written there (damaged or edited)"
            raise DataError(f"{path} {why}: its sha256 differs from {folder / SEAL_NAME}; refusing to use {folder}; "
                            f"{fix} (an edit of your own: delete {SEAL_NAME} to accept the folder as it is)")
    listed = {line.partition("  ")[2] for line in lines} | set(skip)
    for path in sorted(folder.rglob("*")) if exact else ():  # the files `seal` would list
        if path.is_file() and path.name != SEAL_NAME and not path.name.startswith("."):
            if path.relative_to(folder).as_posix() not in listed:
                raise DataError(f"{path} is not listed in {folder / SEAL_NAME} (a file added, or its line deleted, "
                                f"since it was written); refusing to use {folder}; {fix} (a file of your own: move "
                                f"it out of {folder})")


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, *, overwrite: bool = True, sealed: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `target` to build; on success (`sealed`: with its SHA256SUMS) swap it into
    place (an existing target is replaced only then; overwrite=False refuses one up front), on failure remove it."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; choose another folder or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        yield tmp
        if sealed:
            seal(tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes owner-only folders
        if target.exists() and _exchange(tmp, target):
            shutil.rmtree(tmp, ignore_errors=True)  # now the old folder; a kill here leaves a `.tmp` (removable)
        elif target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old"))
            os.replace(target, old / "x")  # move the old folder aside, then the new one in, then drop the old
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux renameat2 RENAME_EXCHANGE), so `b` is never absent; False where the
    system or filesystem cannot (the caller then moves the old folder aside first)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd, rename_exchange = -100, 2
        return libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
    except (OSError, AttributeError):  # no libc symbol (macOS, old glibc)
        return False


def strict_json(value: Any) -> Any:
    """Copy of `value` that `json.dumps(..., allow_nan=False)` accepts (JSON has no NaN / Infinity, and many readers
    reject the tokens Python would write): NaN / inf -> None, numpy / torch scalars and arrays -> Python numbers and
    lists, tuples -> lists, dict keys -> str, paths -> str, dates/times -> ISO text; recursively."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "ndim"):  # numpy / torch scalar or array
        return strict_json(value.tolist())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (datetime.date, datetime.time)):  # also datetime and pandas.Timestamp
        return value.isoformat()
    return value  # anything else must be JSON already: json.dumps names what is not


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write `data` as strict JSON (NaN/inf -> null, indent 2, trailing newline), atomically, creating the folder.
    Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(strict_json(data), indent=2, allow_nan=False) + "\n"
    return atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))


def read_json_object(path: str | os.PathLike, what: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in `path`; a DataError naming the file when it is not valid JSON or not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} must hold {what}, got {type(data).__name__}")
    return data


def read_json_or_empty(path: str | os.PathLike) -> dict[str, Any]:
    """`read_json_object`, or {} when the file is missing, unreadable or torn: for readers that must not fail."""
    try:
        return read_json_object(path)
    except (OSError, ValueError):  # DataError is a ValueError
        return {}
