"""Fault injection for tests: make a training process die after a chosen optimizer step, like a killed job.

    KRONOS_FAULT_EXIT_AFTER_STEP=N   after optimizer step N (and its checkpoint, if one is due) the process exits
    KRONOS_FAULT_RANK=r              only rank r dies (default: every rank)
    KRONOS_FAULT_EXIT_CODE=c         exit code (default 17)

The exit is `os._exit`: no `finally`, no atexit, no flushing, as when the process is killed. Unset, it costs two
environment lookups per optimizer step.
"""

from __future__ import annotations

import os

__all__ = ["FAULT_ENV", "FAULT_RANK_ENV", "FAULT_EXIT_CODE_ENV", "maybe_die_after_step"]

FAULT_ENV = "KRONOS_FAULT_EXIT_AFTER_STEP"
FAULT_RANK_ENV = "KRONOS_FAULT_RANK"
FAULT_EXIT_CODE_ENV = "KRONOS_FAULT_EXIT_CODE"


def maybe_die_after_step(step: int, rank: int) -> None:
    """Exit the process now if the fault variables ask for it after optimizer step `step` on this `rank`."""
    target = int(os.environ.get(FAULT_ENV, "0") or 0)
    if target <= 0 or step != target:
        return
    only_rank = os.environ.get(FAULT_RANK_ENV)
    if only_rank is None or int(only_rank) == rank:
        os._exit(int(os.environ.get(FAULT_EXIT_CODE_ENV, "17")))
