"""One logging setup for every entry point and the engine: rank 0 speaks, the other ranks only warn.

    setup_logging()                          # once per process: rank from torchrun's RANK, INFO, to stderr
    with stage_log(out / "train.log", rank=dist.rank, resumed_from=resume_path, stage="tokenizer"):
        ...                                  # everything logged meanwhile (rank 0) is also appended to train.log

The engine never configures logging itself; it logs through `logging.getLogger(__name__)` and this setup decides
what is shown. Under torchrun every process prints to the same terminal, so records below WARNING are dropped on
ranks other than 0 (a warning or error from any rank is still shown, with its rank in front).

Each stage keeps its own `<stage folder>/train.log`: `stage_log` adds a file handler to the root logger for the
stage and removes it afterwards, so when both stages run in one process each line lands in its stage's file only.
The file is appended to across resumes; every run starts with one header line (time, stage, fresh or resumed,
command line) so the runs in it can be told apart.
"""

from __future__ import annotations

import datetime
import logging
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["RankFilter", "close_stage_log", "open_stage_log", "setup_logging", "stage_log"]

_FORMAT = "%(asctime)s %(levelname)s %(message)s"
_DATEFMT = "%H:%M:%S"
_FILE_DATEFMT = "%Y-%m-%d %H:%M:%S"  # a train.log spans runs on different days


class RankFilter(logging.Filter):
    """Pass every record on rank 0; only WARNING and above on the other ranks (prefixed with the rank)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if self.rank == 0:
            return True
        if record.levelno < logging.WARNING:
            return False
        if not getattr(record, "_rank_tagged", False):
            record.msg = f"[rank {self.rank}] {record.msg}"
            record._rank_tagged = True
        return True


def setup_logging(rank: int | None = None, log_file: str | Path | None = None, level: int = logging.INFO) -> None:
    """Configure the root logger once per process (calling again replaces the handlers it installed before).

    Parameters
    ----------
    rank: this process's global rank; None = torchrun's RANK variable, 0 without torchrun.
    log_file: also append the records to this file (rank 0 only, so ranks never interleave in one file).
    level: lowest level shown on rank 0.
    """
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
        handler.addFilter(RankFilter(rank))
        handler._kronos_setup = True  # marks the handlers a later call may replace
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # warnings.warn(...) goes through the same handlers and filter


def open_stage_log(
    log_file: str | Path, *, rank: int | None = None, resumed_from: str | Path | None = None,
    stage: str | None = None, level: int = logging.INFO,
) -> logging.Handler | None:
    """Start appending every log record (rank 0) to `log_file`, after a header line for this run.

    Parameters
    ----------
    log_file: the stage's log, normally `<stage folder>/train.log` (created with its folder; never truncated).
    rank: this process's global rank; None = torchrun's RANK. Other ranks than 0 get no file and None back.
    resumed_from: the checkpoint this run resumes from (None = a fresh start); shown in the header.
    stage: the stage name shown in the header.
    level: records at this level and above are written (the root logger is lowered to it if it was higher).

    Returns
    -------
    The handler to pass to `close_stage_log`, or None when nothing was added (another rank, or a handler for
    the same file is already attached: no line is ever written twice).
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
    if rank != 0:
        return None
    path = Path(log_file).resolve()
    root = logging.getLogger()
    if any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in root.handlers):
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_FILE_DATEFMT))
    handler.setLevel(level)
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    how = f"resumed from {resumed_from}" if resumed_from is not None else "fresh start"
    where = f"{stage} " if stage else ""
    handler.stream.write(f"===== {now} {where}run ({how}); command: {shlex.join(sys.argv)} =====\n")
    handler.flush()
    handler._kronos_previous_level = root.level  # restored by close_stage_log
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    root.addHandler(handler)
    return handler


def close_stage_log(handler: logging.Handler | None) -> None:
    """Detach and close a handler from `open_stage_log` (None: nothing to do) and restore the root level."""
    if handler is None:
        return
    root = logging.getLogger()
    root.removeHandler(handler)
    handler.close()
    root.setLevel(getattr(handler, "_kronos_previous_level", root.level))


@contextmanager
def stage_log(
    log_file: str | Path, *, rank: int | None = None, resumed_from: str | Path | None = None,
    stage: str | None = None, level: int = logging.INFO,
) -> Iterator[logging.Handler | None]:
    """`open_stage_log` for the duration of a `with` block, closed on success and on failure alike."""
    handler = open_stage_log(log_file, rank=rank, resumed_from=resumed_from, stage=stage, level=level)
    try:
        yield handler
    finally:
        close_stage_log(handler)
