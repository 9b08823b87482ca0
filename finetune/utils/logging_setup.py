"""One logging setup for every entry point and the engine: rank 0 speaks, the other ranks only warn.

    setup_logging()                          # rank from torchrun's RANK (0 without torchrun), INFO, to stderr
    setup_logging(dist.rank, log_file=out / "train.log")

The engine never configures logging itself; it logs through `logging.getLogger(__name__)` and this setup decides
what is shown. Under torchrun every process prints to the same terminal, so records below WARNING are dropped on
ranks other than 0 (a warning or error from any rank is still shown, with its rank in front).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

__all__ = ["setup_logging", "RankFilter"]

_FORMAT = "%(asctime)s %(levelname)s %(message)s"
_DATEFMT = "%H:%M:%S"


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
