"""Run safety, in one place; each decision is a small function of its inputs: `RunLock`, `GracefulStop`, the
non-finite guard and the kill-loop tests' fault injection (KRONOS_FAULT_* variables): docs/architecture.md,
"Formats and designs"."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NamedTuple

import filelock
import torch

from finetune.utils.distributed import all_reduce_sum
from finetune.utils.errors import DivergenceError, RunLockedError, TrainingStopped
from model.errors import EXIT_STOPPED, PathError
from model.fileio import read_json_or_empty

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


LOCK_NAME = "run.lock"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) a run lock, as written into the lock file."""

    pid: int | None  # Process id of the holder (None when the file could not be read).
    host: str  # Host name the holder runs on.
    started: str  # ISO-8601 local time the holder took the lock.
    argv: str = ""  # The holder's command line, for the user to recognise it.

    def describe(self) -> str:
        """One human-readable phrase, e.g. `pid 123 on host gpu1 (started 2025-01-02T03:04:05+01:00)`."""
        who = f"pid {self.pid}" if self.pid is not None else "an unknown process"
        text = f"{who} on host {self.host or '?'} (started {self.started or '?'})"
        return f"{text}: {self.argv}" if self.argv else text


def read_holder(path: str | Path) -> LockHolder:
    """Parse a lock file's JSON; an empty/garbled file gives a holder with pid None (still a valid description)."""
    data = read_json_or_empty(path)
    pid = data.get("pid")
    return LockHolder(pid=pid if isinstance(pid, int) else None, host=str(data.get("host", "")),
                      started=str(data.get("started", "")), argv=str(data.get("argv", "")))


class RunLock:
    """Exclusive lock on an output `folder` (created if missing, removed on release if the run left it empty), held
    from `acquire()` (or `with`) until `release()`. `enabled=False` makes every method a no-op, so all ranks run
    the same code (`enabled=dist.is_main`); `key` is the setting naming the folder, quoted in the error; `log`
    (default: this module's logger at WARNING) gets the stale-lock takeover line. The OS lock is `filelock`'s
    (the kernel drops it when the holder dies); the file also records the holder, for the error and the takeover
    line."""

    def __init__(self, folder: str | Path, *, enabled: bool = True, key: str = "training.output_dir",
                 log: Callable[[str], None] | None = None, name: str = LOCK_NAME):
        self.folder = Path(folder)
        self.path = self.folder / name  # `name`: the lock of something beside it, e.g. a folder swapped whole
        self.enabled = enabled
        self.key = key
        self._log = log or _log.warning
        self._lock = filelock.FileLock(self.path, on_acquired=self._write_holder)
        self._created_folder = False
        self.took_over: LockHolder | None = None  # the previous holder when a stale lock was taken over

    @property
    def held(self) -> bool:
        """True between a successful `acquire()` and `release()`."""
        return self._lock.is_locked

    def acquire(self) -> RunLock:
        """Take the lock or raise `RunLockedError` at once (never waits). Returns self."""
        if not self.enabled or self.held:
            return self
        try:
            if not self.folder.exists():
                self.folder.mkdir(parents=True, exist_ok=True)
                self._created_folder = True
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            raise RunLockedError(self.folder, read_holder(self.path), self.key) from None
        except OSError as e:  # a read-only filesystem, no permission: the user's to fix, not a bug
            raise PathError(f"{self.key}: cannot write into {self.folder} ({e.strerror or e}); set {self.key} to a "
                            "writable folder") from None
        return self

    def _write_holder(self, fd: int) -> None:
        previous = read_holder(self.path)
        if previous.pid is not None:
            # The kernel released the old holder's lock, so it is no longer running (or closed the file).
            self.took_over = previous
            self._log(f"{self.path}: taking over the stale lock of {previous.describe()} (no longer running)")
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "argv": " ".join(sys.argv)}
        os.ftruncate(fd, 0)  # written through the lock's own descriptor, as soon as the lock is taken
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent; safe to call when never acquired)."""
        if not self.held:
            return
        try:
            # Unlink while still locked, so a waiter that opened the old file re-checks the inode and retries.
            self.path.unlink(missing_ok=True)
        finally:
            self._lock.release()
        if self._created_folder:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # only succeeds if the run wrote nothing: leave no empty folder behind

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


FORWARD_GRACE_S = 0.3
"""A second signal this soon after the first counts as the same request forwarded by a launcher, not a user's
second Ctrl-C."""

STOPPED_EXIT_CODE = EXIT_STOPPED  # a run that stopped on a signal after saving (EX_TEMPFAIL: resume it later)


def _write_line(text: str) -> None:
    with contextlib.suppress(OSError):  # stderr closed: nothing useful to do in a signal handler
        os.write(2, (text.rstrip("\n") + "\n").encode())


class GracefulStop:
    """Context manager installing the two-stage handlers of SIGTERM and SIGINT (main thread only); `enabled=False`
    makes it a no-op (e.g. for library use inside another program's loop). Entered while another one is active, it
    gives back that one: a run's stages share the run's stop request, which outlives each stage's loop."""

    active: GracefulStop | None = None  # the outermost entered instance (its handlers are installed), None outside any

    def __init__(self, *, enabled: bool = True):
        self.enabled = enabled
        self.signal_name: str | None = None
        """Name of the first signal received ('SIGTERM' / 'SIGINT'), None while none arrived."""
        self._previous: dict[int, Any] = {}
        self._first_at = 0.0  # time.monotonic() of the first signal

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived (this process only; the ranks agree in `check_step`)."""
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
        if GracefulStop.active is not None:
            return GracefulStop.active
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        GracefulStop.active = self
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if GracefulStop.active is self:
            GracefulStop.active = None


def raise_if_stop_requested(where: str, dist: Any = None) -> None:
    """A safe point outside the training loop: raise `TrainingStopped` ("stopped on SIGTERM `where`; run the same
    command again ...") when a stop signal arrived since the run's `GracefulStop` was entered. Call it where all
    work so far is on disk. `dist`: the run's DistInfo when every rank reaches this point (the ranks agree in one
    all-reduce, so none goes on alone into a collective); None on one rank (scoring, calibration)."""
    stopper = GracefulStop.active
    requested = stopper is not None and stopper.requested
    if dist is not None and dist.world_size > 1:
        requested = check_step(0.0, None, dist, requested)[1]
    if requested:
        raise TrainingStopped(stopper.signal_name if stopper and stopper.signal_name else "a signal to another process",
                              where=where)


EARLY_STEPS = 3  # a non-finite loss within this many finite steps of the start points at the data, not the optimisation
LOSS_GROWTH = 2.0  # the loss counts as having grown when its last value is this many times the window's early median
GRAD_EXPLOSION = 10.0  # the gradient norm counts as exploding when its last is this many times the window's median


class StepStats(NamedTuple):
    """One finite optimizer step remembered for the diagnosis."""

    step: int
    loss: float
    grad_norm: float | None


def _all_finite_flag(values: Sequence[torch.Tensor | float | None]) -> torch.Tensor:
    """0-d int32 tensor: 1 when some value is non-finite, else 0 (stays on the values' device: no sync here)."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    bad = torch.zeros((), dtype=torch.int32, device=device)
    for v in values:  # None: not computed
        if isinstance(v, torch.Tensor):
            bad = bad | (~torch.isfinite(v.detach())).any().to(device=device, dtype=torch.int32)
        elif v is not None and not math.isfinite(float(v)):
            bad = bad | 1
    return bad


def check_step(loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None, dist: Any = None,
               stop: bool = False) -> tuple[bool, bool]:
    """(loss and grad_norm finite on EVERY rank, any rank asked to stop): one all-reduce sum of two 0/1 ints per
    optimizer step carries both flags (no collective in a single process; on `dist.device`: nccl needs the GPU).
    `grad_norm`: what `clip_grad_norm_` returned, or None; `stop`: this rank's `GracefulStop.requested`."""
    bad = _all_finite_flag([loss, grad_norm])
    flags = torch.stack([bad, torch.tensor(1 if stop else 0, dtype=torch.int32, device=bad.device)])  # (2,)
    bad_any, stop_any = all_reduce_sum(flags.to(getattr(dist, "device", None) or bad.device)).tolist()
    return not bad_any, bool(stop_any)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def diagnose(history: Sequence[StepStats], amp: bool, step: int, loss: float, grad_norm: float | None = None, *,
             data_extremes: str | None = None, lr_key: str = "training.lr",
             clip_key: str = "training.clip_grad_norm") -> str:
    """The most likely reason the optimizer step `step` (1-based) went non-finite, as one sentence starting "most
    likely a data value", "... the learning rate" or "... bf16" that names the setting to change (`lr_key`,
    `clip_key`: the stage section's keys where it sets them, as they shadow `training:`'s). `history`: the recent
    FINITE steps, oldest first; `loss` / `grad_norm` (None when not computed) the failing step's; `data_extremes`
    what the data check flagged (e.g. "volume up to 3.1e+38 in a.csv")."""
    if data_extremes:
        return (f"most likely a data value: the data check reported extreme values ({data_extremes}); "
                "correct or remove them in the data")
    loss_bad = not math.isfinite(loss)
    if loss_bad and len(history) < EARLY_STEPS:
        return (f"most likely a data value: the loss was non-finite in the forward pass at step {step}, before "
                f"{EARLY_STEPS} finite steps (the weights are still the pretrained ones), so an input window holds "
                "a NaN/inf or extreme value; check the data" + (" (or turn off bf16 with training.amp=none)" if amp
                                                                 else ""))
    recent = list(history)[-20:]
    losses = [h.loss for h in recent]
    early = statistics.median(losses[: max(1, len(losses) // 2)]) if losses else 0.0
    last = losses[-1] if losses else 0.0
    if not losses:
        grew = False
    elif early > 0:
        grew = last >= LOSS_GROWTH * early
    else:  # a loss that can be negative (the tokenizer's BSQ terms): an absolute rise of at least |early|
        grew = last - early > max(abs(early), 1e-3)
    norms = [h.grad_norm for h in recent if h.grad_norm is not None and math.isfinite(h.grad_norm)]
    now_norm = grad_norm if grad_norm is not None and math.isfinite(grad_norm) else (norms[-1] if norms else None)
    exploding = len(norms) >= 2 and now_norm is not None and now_norm > GRAD_EXPLOSION * statistics.median(norms)
    grad_only = not loss_bad and grad_norm is not None and not math.isfinite(grad_norm)
    if grew or exploding or (grad_only and not amp):
        evidence = []
        if grew:
            evidence.append(f"the loss grew from {_fmt(early)} to {_fmt(last)}")
        if exploding:
            evidence.append(f"the gradient norm rose to {_fmt(now_norm)} (median {_fmt(statistics.median(norms))})")
        if grad_only:
            evidence.append("the loss was finite but the gradient overflowed")
        return (f"most likely the learning rate: {' and '.join(evidence)} before step {step}; lower {lr_key} "
                f"(or set {clip_key})")
    if amp:
        return (f"most likely bf16: the loss was stable (about {_fmt(last)}) and turned non-finite at step {step} "
                f"with mixed precision on; set training.amp=none")
    return (f"most likely a data value: the loss was stable (about {_fmt(last)}) and turned non-finite at once at "
            f"step {step}, which points at one bad batch (a NaN/inf or extreme candle); check the data")


class NonFiniteGuard:
    """Per-run state of the guard: remembers the last `window` finite steps and raises `DivergenceError` on a bad
    one, with `diagnose`'s sentence (`amp`, `data_extremes` and the setting names `keys`, e.g. {"lr_key":
    "predictor_training.lr"}, feed it)."""

    def __init__(self, *, amp: bool, dist: Any = None, data_extremes: str | None = None, window: int = 50,
                 keys: dict[str, str] | None = None):
        self.amp, self.dist, self.data_extremes, self.keys = amp, dist, data_extremes, keys or {}
        self.history: deque[StepStats] = deque(maxlen=window)
        self.pending: tuple[int, torch.Tensor, Any, bool] | None = None  # `check_later`'s step, not yet read

    def check(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None,
              stop: bool = False) -> bool:
        """Call once per optimizer step before `optimizer.step()`; raises `DivergenceError` on every rank if any
        rank's loss or gradient norm is non-finite. `stop`: this rank's stop request (`GracefulStop.requested`);
        returns whether any rank asked to stop (agreed in the same all-reduce)."""
        finite, stop_any = check_step(loss, grad_norm, self.dist, stop)
        self._verdict(step, finite, float(loss), None if grad_norm is None else float(grad_norm))
        return stop_any

    def check_later(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """`check` for one process without waiting for the device: reads the previous step's verdict (`settle`),
        queues this step's flag, loss and norm for the host, and returns the flag as a float32 0-d tensor (1.0 =
        non-finite) for a fused optimizer's `found_inf`, which then skips the step on the device (as GradScaler
        does). The step's DivergenceError comes at the next `check_later` or `settle`: call `settle` before
        anything is saved or logged."""
        self.settle()
        bad = _all_finite_flag([loss, grad_norm]).float()
        norm = bad * 0 if grad_norm is None else grad_norm.detach().float()
        host = torch.stack([bad, loss.detach().float(), norm]).to("cpu", non_blocking=True)  # (3,), pinned on CUDA
        event = None
        if bad.is_cuda:  # the copy is done when this event is: no wait for work queued after it
            event = torch.cuda.Event()
            event.record()
        self.pending = (step, host, event, grad_norm is not None)
        return bad

    def settle(self) -> None:
        """Read `check_later`'s pending verdict (raises DivergenceError for a non-finite step)."""
        if self.pending is None:
            return
        step, host, event, has_norm = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        bad, loss_f, norm_f = host.tolist()
        self._verdict(step, not bad, loss_f, norm_f if has_norm else None)

    def _verdict(self, step: int, finite: bool, loss_f: float, norm_f: float | None) -> None:
        if finite:
            self.history.append(StepStats(step, loss_f, norm_f))
            return
        text = diagnose(self.history, self.amp, step, loss_f, norm_f, data_extremes=self.data_extremes, **self.keys)
        here_finite = math.isfinite(loss_f) and (norm_f is None or math.isfinite(norm_f))
        local = " on another rank" if here_finite else ""
        cause = text.split(":", 1)[0].removeprefix("most likely ")
        cause = {"a data value": "data", "the learning rate": "lr", "bf16": "bf16"}.get(cause)
        raise DivergenceError(f"training diverged at step {step}{local} (loss {_fmt(loss_f)}, gradient norm "
                              f"{_fmt(norm_f)}); nothing of this step was applied: {text}", step=step, cause=cause)
