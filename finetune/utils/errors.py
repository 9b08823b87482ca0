"""User errors versus bugs: how every entry point reports a failure (`run_main`: a user error is ONE `error: ...`
line, a bug keeps its traceback; `--debug` / KRONOS_DEBUG=1 add it), the engine's own error classes and the one
logging setup. Details: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import datetime
import errno
import functools
import importlib.util
import logging
import os
import shlex
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from model.errors import (
    EXIT_BUG,
    EXIT_DATA,
    EXIT_INTERRUPTED,
    EXIT_MISSING_EXTRA,
    EXIT_OK,
    EXIT_PATH,
    EXIT_REFUSED,
    EXIT_STOPPED,
    OPTIONAL_MODULES,
    ConfigError,
    DataError,
    MissingExtraError,
    RefusedError,
    UserError,
)
from model.fileio import disk_full


class CheckpointError(DataError):
    """No checkpoint in a folder could be loaded; the message lists each file and why."""


class CheckpointWriteError(UserError, OSError):
    """A checkpoint could not be written for lack of space (or a file-size limit); names file, free and needed
    (`checkpoint.space_error` builds it; `.needed`: the bytes)."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28] ...: 'path'" decoration
        return str(self.strerror)


class DivergenceError(DataError):
    """Training produced a non-finite loss or gradient; the message names the most likely cause and the fix."""

    def __init__(self, message: str, step: int | None = None, cause: str | None = None):
        super().__init__(message)
        self.step = step
        self.cause = cause  # "data" | "lr" | "bf16" | None


class NonFiniteWeightsError(DivergenceError):
    """A state dict about to be written holds NaN/inf; nothing was written."""


class RunLockedError(RefusedError, ValueError):
    """Another live run holds the output folder's lock (a user mistake: two runs into one folder)."""

    def __init__(self, folder: Path, holder: Any, key: str):  # holder: safety.LockHolder
        self.folder = folder
        self.holder = holder
        super().__init__(f"{key}: another run is already writing into {folder}: {holder.describe()}.\n"
                         f"  Wait for it to finish, stop it, or set {key} to a different folder.")


class StageFolderError(RefusedError, ValueError):
    """The stage folder's content and training.resume / training.overwrite disagree (a user decision is needed)."""


class TrainingStopped(UserError):
    """Raised by the loop after it saved on a stop request; the entry point prints `str(e)` and exits with
    `exit_code` (75: the same command resumes)."""

    exit_code = EXIT_STOPPED

    def __init__(self, signal_name: str, checkpoint: str | Path | None = None, step: int | None = None,
                 where: str | None = None):
        self.signal_name = signal_name
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.step = step
        at = f" at step {step}" if step is not None else f" {where}" if where else ""
        saved = f"; saved {self.checkpoint}" if self.checkpoint is not None else ""
        super().__init__(f"stopped on {signal_name}{at}{saved}; run the same command again to resume from there")


class StoreError(DataError):
    """A store that cannot be written, opened or trusted; the message names the file and what to do."""


class TrackerUnavailable(ConfigError):
    """A tracker is enabled in the config but its package is not installed."""


_DEBUG_FLAG = "--debug"
_DEBUG_HINT = f"(add {_DEBUG_FLAG} or set KRONOS_DEBUG=1 to see the traceback)"


def require_extra(module: str) -> None:
    """Raise `MissingExtraError` naming this command and the extra that installs `module` unless it is importable."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or the module is hidden (sys.modules[m] = None)
        found = False
    if not found or sys.modules.get(module, "") is None:
        raise MissingExtraError.for_module(module, os.path.basename(sys.argv[0]) or "this command")


def classify(exc: BaseException) -> tuple[int, bool]:
    """(exit code, is a user error) of an exception escaping `main` (docs/architecture.md)."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, True
    if isinstance(exc, UserError):
        return exc.exit_code, True
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in OPTIONAL_MODULES:
        return EXIT_MISSING_EXTRA, True
    if isinstance(exc, FileExistsError):
        return EXIT_REFUSED, True
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)) or \
            isinstance(exc, OSError) and exc.errno == errno.EROFS:  # a read-only output filesystem
        return EXIT_PATH, True
    hub = sys.modules.get("huggingface_hub.errors") or sys.modules.get("huggingface_hub.utils")
    hub_kinds = tuple(getattr(hub, n) for n in ("HfHubHTTPError", "LocalEntryNotFoundError", "OfflineModeIsEnabled",
                                                "RepositoryNotFoundError", "RevisionNotFoundError") if hasattr(hub, n))
    if hub_kinds and isinstance(exc, hub_kinds):
        return EXIT_PATH, True
    if disk_full(exc):  # the machine's state, not a bug: no traceback
        return EXIT_DATA, True
    return EXIT_BUG, False


def format_error(exc: BaseException, code: int) -> str:
    """The message printed for a user error: `error: <first line>` then any further lines of the message."""
    if isinstance(exc, KeyboardInterrupt):
        return "error: interrupted (Ctrl-C); checkpoints/last.pt holds the last completed epoch or save step"
    if code == EXIT_STOPPED:  # a graceful stop is not an error: one line, the step saved and how to go on
        return str(exc)
    if isinstance(exc, ModuleNotFoundError) and not isinstance(exc, MissingExtraError) and code == EXIT_MISSING_EXTRA:
        return "error: " + str(MissingExtraError.for_module(exc.name or "?"))
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror and not isinstance(exc, UserError):
        text = f"{exc.strerror}: {exc.filename}"  # `[Errno 2] No such file ...: 'x'` -> `No such file ...: x`
    else:
        text = str(exc) or type(exc).__name__
    rank = os.environ.get("RANK")
    several = os.environ.get("WORLD_SIZE", "1") != "1"
    prefix = f"error (rank {rank}): " if rank not in (None, "0") and several else "error: "
    return prefix + text.strip()


def _quit_now(signum: int, frame: Any) -> None:
    os.write(2, b"error: interrupted again; quitting now\n")
    os._exit(EXIT_INTERRUPTED)


def run_main(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> int:
    """Run `main(argv)` (default argv: `sys.argv[1:]`, less `--debug`, which turns tracebacks on) and return the
    process exit code (`EXIT_*`; an int that `main` returns is passed through), reporting failures as described
    above."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # `--debug` after `--` belongs to the command
    args = [a for i, a in enumerate(argv) if a != _DEBUG_FLAG or i > cut]
    debug = len(args) < len(argv) or os.environ.get("KRONOS_DEBUG", "").strip().lower() not in ("", "0", "false", "no")
    try:
        result = main(args)
    except SystemExit as exc:  # argparse (--help, usage errors) and scripts' own `SystemExit("...")`
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        message = str(exc.code)
        print(message if message.startswith("error") else f"error: {message}", file=sys.stderr)
        return EXIT_DATA
    except BaseException as exc:  # noqa: BLE001 - this IS the top-level handler
        code, is_user = classify(exc)
        if code in (EXIT_INTERRUPTED, EXIT_STOPPED) and threading.current_thread() is threading.main_thread():
            # On the way out: one more Ctrl-C ends the process at once with one line, not a KeyboardInterrupt
            # traceback from wherever the exit happens to be (cleanup, atexit, threads).
            signal.signal(signal.SIGINT, _quit_now)
        sys.stderr.flush()
        if is_user:
            print(format_error(exc, code), file=sys.stderr)
            if debug:
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            elif code not in (EXIT_INTERRUPTED, EXIT_STOPPED):  # a stop that saved is no failure to debug
                print(_DEBUG_HINT, file=sys.stderr)
        else:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            print(f"error: unexpected {type(exc).__name__} (a bug; please report it with the traceback above): "
                  f"{exc}", file=sys.stderr)
        sys.stderr.flush()
        return code
    return result if isinstance(result, int) and not isinstance(result, bool) else EXIT_OK


_FORMAT = "%(asctime)s %(levelname)s %(message)s"
_DATEFMT = "%H:%M:%S"
_FILE_DATEFMT = "%Y-%m-%d %H:%M:%S"  # a train.log spans runs on different days


def _other_rank_filter(rank: int, record: logging.LogRecord) -> bool:
    """The log filter of a rank other than 0: only WARNING and above pass, prefixed with the rank."""
    if record.levelno < logging.WARNING:
        return False
    if not getattr(record, "_rank_tagged", False):
        record.msg = f"[rank {rank}] {record.msg}"
        record._rank_tagged = True
    return True


def setup_logging(rank: int | None = None, log_file: str | Path | None = None) -> None:
    """Configure the root logger once per process (calling again replaces the handlers it installed before).
    `rank` None = torchrun's RANK (0 without torchrun); `log_file` also gets the records, on rank 0 only (ranks
    never interleave in one file); rank 0 shows INFO and above."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_kronos_setup", False)]:
        root.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None and rank == 0:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATEFMT))
        if rank != 0:  # rank 0 shows every record
            handler.addFilter(functools.partial(_other_rank_filter, rank))
        handler._kronos_setup = True  # marks the handlers a later call may replace
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings.warn(...) goes through the same handlers and filter


@contextmanager
def stage_log(log_file: str | Path, *, rank: int | None = None, resumed_from: str | Path | None = None,
              stage: str | None = None) -> Iterator[logging.Handler | None]:
    """For the `with` block, append every log record of rank 0 at INFO and above to `log_file` (normally `<stage
    folder>/train.log`; never truncated) after a header line naming the `stage`, the checkpoint it `resumed_from`
    (None = a fresh start) and the command; on exit, success or failure, detach it and restore the root level.
    Yields the handler, or None when nothing was added (another rank, or a handler for the same file is already
    attached: no line is ever written twice)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
    path = Path(log_file).resolve()
    root = logging.getLogger()
    if rank != 0 or any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in root.handlers):
        yield None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_FILE_DATEFMT))
    handler.setLevel(logging.INFO)
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    how = f"resumed from {resumed_from}" if resumed_from is not None else "fresh start"
    where = f"{stage} " if stage else ""
    from model.predictor import use_chosen_threads  # torch: loaded by then

    handler.stream.write(f"===== {now} {where}run ({how}); command: {shlex.join(sys.argv)}; "
                         f"{use_chosen_threads()} =====\n")
    handler.flush()
    previous_level = root.level
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(previous_level)
