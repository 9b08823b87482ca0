"""One run per output folder: an OS-level lock that rank 0 holds for the whole run.

The rule: before a run writes anything into its output folder, rank 0 takes `<folder>/run.lock` with
`fcntl.flock(LOCK_EX | LOCK_NB)` and keeps it until the run ends. A second run into the same folder fails at once
with a `RunLockedError` naming the holder (pid, host, start time, command) instead of both runs "succeeding" while
overwriting each other's checkpoints.

    with RunLock(out_dir, enabled=dist.is_main, key="training.output_dir"):
        ...  # the whole run: clean orphans, train, save

Why flock: the kernel drops the lock when the holding process dies, however it dies (exception, SIGKILL, OOM kill,
power loss of a local disk), so a killed run never blocks the next one. The file's content (JSON: pid, host,
started, argv) is only for the error message. A lock file left by a dead process is therefore "stale": the next run
gets the lock, logs one line naming the previous holder and takes it over.

On release the lock file is removed. Removing a flock'd file is racy (a waiter may lock the unlinked inode), so
`acquire` checks after locking that the path still names the inode it locked and retries otherwise.

Where flock is unavailable (no fcntl, or a filesystem answering ENOLCK/EOPNOTSUPP), the lock falls back to an
exclusive-create file plus a liveness check of the recorded pid on the same host; a lock file written on another
host cannot be checked and is treated as held (the message says how to remove it).

The file descriptor is close-on-exec, so processes started with subprocess do not inherit the lock; forked children
(DataLoader workers) share it, which is harmless because they die with the run.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ..errors import RefusedError

try:  # POSIX only; Windows falls back to exclusive create + pid check
    import fcntl
except ImportError:  # pragma: no cover - not on Linux/macOS
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "LockHolder", "RunLock", "RunLockedError", "read_holder"]

LOCK_NAME = "run.lock"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) a run lock, as written into the lock file."""

    pid: int | None
    """Process id of the holder (None when the file could not be read)."""
    host: str
    """Host name the holder runs on."""
    started: str
    """ISO-8601 local time the holder took the lock."""
    argv: str = ""
    """The holder's command line, for the user to recognise it."""

    def describe(self) -> str:
        """One human-readable phrase, e.g. `pid 123 on host gpu1 (started 2025-01-02T03:04:05+01:00)`."""
        who = f"pid {self.pid}" if self.pid is not None else "an unknown process"
        text = f"{who} on host {self.host or '?'} (started {self.started or '?'})"
        return f"{text}: {self.argv}" if self.argv else text


class RunLockedError(RefusedError, ValueError):
    """Another live run holds the output folder's lock (a user mistake: two runs into one folder)."""

    def __init__(self, folder: Path, holder: LockHolder, key: str):
        self.folder = folder
        self.holder = holder
        super().__init__(
            f"{key}: another run is already writing into {folder}: {holder.describe()}.\n"
            f"  Wait for it to finish, stop it, or set {key} to a different folder."
        )


def read_holder(path: str | Path) -> LockHolder:
    """Parse a lock file's JSON; an empty/garbled file gives a holder with pid None (still a valid description)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    pid = data.get("pid")
    return LockHolder(pid=pid if isinstance(pid, int) else None, host=str(data.get("host", "")),
                      started=str(data.get("started", "")), argv=str(data.get("argv", "")))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """Exclusive lock on an output folder, held from `acquire()` (or `with`) until `release()`.

    Parameters
    ----------
    folder: the run's output folder; created if missing (and removed again on release if the run left it empty).
    enabled: False makes every method a no-op, so all ranks can run the same code (`enabled=dist.is_main`).
    key: the setting naming the folder, quoted in the error so the user knows what to change.
    log: where the stale-lock takeover line goes (default: this module's logger at WARNING).
    """

    def __init__(self, folder: str | Path, *, enabled: bool = True, key: str = "training.output_dir",
                 log: Callable[[str], None] | None = None):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.enabled = enabled
        self.key = key
        self._log = log or _log.warning
        self._fd: int | None = None
        self._mode: str | None = None  # "flock" or "exclusive"
        self._created_folder = False
        self.took_over: LockHolder | None = None
        """The previous holder when a stale lock was taken over, else None."""

    @property
    def held(self) -> bool:
        """True between a successful `acquire()` and `release()`."""
        return self._mode is not None

    def acquire(self) -> RunLock:
        """Take the lock or raise `RunLockedError` at once (never waits). Returns self."""
        if not self.enabled or self.held:
            return self
        if not self.folder.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            self._created_folder = True
        if fcntl is not None:
            try:
                self._acquire_flock()
                return self
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                self._log(f"{self.path}: the filesystem does not support flock ({e.strerror}); "
                          "using an exclusive lock file with a pid check instead")
        self._acquire_exclusive()
        return self

    def _acquire_flock(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLockedError(self.folder, read_holder(self.path), self.key) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed the file between our open and our lock: lock the new one
        previous = read_holder(self.path)
        if previous.pid is not None:
            # The kernel released the old holder's lock, so it is no longer running (or closed the file).
            self.took_over = previous
            self._log(f"{self.path}: taking over the stale lock of {previous.describe()} (no longer running)")
        self._write_holder(fd)
        self._fd, self._mode = fd, "flock"

    def _acquire_exclusive(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                stale = holder.host == socket.gethostname() and holder.pid is not None and not _pid_alive(holder.pid)
                if not stale:
                    raise RunLockedError(self.folder, holder, self.key) from None
                self.took_over = holder
                self._log(f"{self.path}: taking over the stale lock of {holder.describe()} (no longer running)")
                self.path.unlink(missing_ok=True)
                continue
            self._write_holder(fd)
            self._fd, self._mode = fd, "exclusive"
            return
        raise RunLockedError(self.folder, read_holder(self.path), self.key)

    def _write_holder(self, fd: int) -> None:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": " ".join(sys.argv),
        }
        data = (json.dumps(info) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent; safe to call when never acquired)."""
        if not self.held:
            return
        fd, self._fd, self._mode = self._fd, None, None
        try:
            # Unlink while still locked, so a waiter that opened the old file re-checks the inode and retries.
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock
        if self._created_folder:
            try:
                self.folder.rmdir()  # only succeeds if the run wrote nothing: leave no empty folder behind
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
