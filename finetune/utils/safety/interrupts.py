"""Graceful stop on SIGTERM / SIGINT (Ctrl-C): finish the current step, save, exit with one line.

The rule:
- The first SIGTERM or SIGINT only sets a flag (and writes one line to stderr). The training loop calls
  `stop_requested()` after each optimizer step, makes all ranks agree with `agree_to_stop(flag, dist)` (a rank that
  got no signal must stop at the same step, or the next collective hangs), saves a resumable checkpoint and raises
  `TrainingStopped`. The entry point catches it, prints its one-line message and exits with `STOPPED_EXIT_CODE`
  (75, EX_TEMPFAIL from sysexits.h: "temporary failure, retry later" - rerun with resume to continue).
- A second signal while the first is being handled exits immediately via `os._exit(128 + signum)` (130 for
  Ctrl-C) after one line: no traceback, no save. Except: a repeated SIGTERM, or any second signal within
  `FORWARD_GRACE_S` of the first, is the same request delivered twice - torchrun's agent forwards the SIGTERM/SIGINT
  it got to workers that already got it from the terminal or the scheduler (which escalates with SIGKILL anyway).
  Temporary files such a hard exit leaves are removed the next time the folder is opened
  (`checkpoint_store.remove_orphans`); the run lock is released by the kernel.
- Leaving the `GracefulStop` context restores the previous handlers, so the rest of the program (and tests) keep
  the usual Ctrl-C behaviour.

The handler writes with `os.write` because Python-level `print` from a signal handler can hit a reentrant call on
a buffered stream the interrupted code was writing to.

    with GracefulStop() as stopper:
        for batch in loader:
            ...; optimizer.step()
            if agree_to_stop(stopper.requested, dist):
                save_checkpoint(...)
                raise TrainingStopped(stopper.signal_name, checkpoint_path)

Under torchrun, Ctrl-C reaches every rank (they share the terminal's process group) and the agent forwards
SIGTERM; `agree_to_stop` makes the ranks stop at the same step either way. DataLoader worker processes get the
terminal's SIGINT too: pass `ignore_interrupts_in_worker` as the loader's `worker_init_fn` so the workers keep
serving batches until the main process stops them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from ..errors import EXIT_STOPPED, UserError

__all__ = [
    "FORWARD_GRACE_S",
    "STOPPED_EXIT_CODE",
    "GracefulStop",
    "TrainingStopped",
    "agree_to_stop",
    "ignore_interrupts_in_worker",
    "stop_requested",
]

FORWARD_GRACE_S = 0.3
"""A second signal this soon after the first counts as the same request forwarded by a launcher, not a user's
second Ctrl-C."""

STOPPED_EXIT_CODE = EXIT_STOPPED
"""Exit status of a run that stopped on a signal after saving (EX_TEMPFAIL: resume it later)."""

_ACTIVE: list[GracefulStop] = []  # innermost last; stop_requested() asks the innermost


class TrainingStopped(UserError):
    """Raised by the loop after it saved on a stop request; the entry point prints `str(e)` and exits with
    `exit_code`."""

    exit_code = STOPPED_EXIT_CODE

    def __init__(self, signal_name: str, checkpoint: str | Path | None = None, step: int | None = None):
        self.signal_name = signal_name
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.step = step
        at = f" at step {step}" if step is not None else ""
        saved = f"; saved {self.checkpoint}" if self.checkpoint is not None else ""
        super().__init__(f"stopped on {signal_name}{at}{saved}; run the same command again to resume from there")


def _write_line(text: str) -> None:
    try:
        os.write(2, (text.rstrip("\n") + "\n").encode())
    except OSError:  # stderr closed: nothing useful to do in a signal handler
        pass


class GracefulStop:
    """Context manager installing the two-stage SIGTERM/SIGINT handlers (main thread only).

    Parameters
    ----------
    signals: which signals request a stop (default SIGTERM and SIGINT).
    enabled: False makes it a no-op (e.g. for library use inside another program's loop).
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT), *, enabled: bool = True):
        self.signals = tuple(signals)
        self.enabled = enabled
        self.signal_name: str | None = None
        """Name of the first signal received ('SIGTERM' / 'SIGINT'), None while none arrived."""
        self._previous: dict[int, Any] = {}
        self._first_at = 0.0  # time.monotonic() of the first signal

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived (this process only; use `agree_to_stop` across ranks)."""
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            self._first_at = time.monotonic()
            _write_line(f"received {name}: finishing the current step, saving a checkpoint and stopping "
                        "(send it again to quit at once without saving)")
            return
        if signum == signal.SIGTERM or time.monotonic() - self._first_at < FORWARD_GRACE_S:
            return  # the same stop request again (a launcher forwarding it): keep stopping gracefully
        _write_line(f"received {name} again: quitting now without saving")
        os._exit(128 + signum)

    def __enter__(self) -> GracefulStop:
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return self  # signal.signal only works in the main thread; nothing to install elsewhere
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)


def stop_requested() -> bool:
    """True when the innermost active `GracefulStop` received a stop signal (False when none is active)."""
    return bool(_ACTIVE) and _ACTIVE[-1].requested


def agree_to_stop(flag: bool, dist: Any = None) -> bool:
    """Whether ANY rank asked to stop (all-reduce MAX of a 0/1 tensor); `flag` itself without a process group.

    Every rank must call it at the same point (after each optimizer step), so all stop at the same step.

    Parameters
    ----------
    flag: this rank's `stop_requested()`.
    dist: the run's `DistInfo` (its `device` holds the tensor: nccl needs it on the GPU) or None.

    Returns
    -------
    True on every rank if at least one rank's flag was True.
    """
    import torch  # imported here so a process that never trains (and the tests' subprocesses) skip its import
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return bool(flag)
    device = getattr(dist, "device", None) or torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)  # (1,)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item())


def ignore_interrupts_in_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: workers ignore SIGINT so a Ctrl-C stops the run gracefully, not the loader."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
