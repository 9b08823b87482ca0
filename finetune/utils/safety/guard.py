"""The non-finite guard: stop at the first step whose loss or gradient is NaN/inf, say why, never write bad weights.

The rule:
- Every optimizer step, after `clip_grad_norm_` and BEFORE `optimizer.step()`, the loop calls
  `NonFiniteGuard.check(step, loss, grad_norm)`. A non-finite value on any rank stops every rank at that step (one
  all-reduce of one number, so no rank goes on to a collective the others never reach), and the weights are never
  updated with NaN gradients. Checking only at log steps let NaN weights reach `last.pt`.
- The `DivergenceError` says which cause is most likely, from the recent history (`diagnose`, a pure function):
    * a data value - the data check reported extreme values, or the loss was non-finite on the first steps (the
      weights are still the pretrained ones, so the input is the suspect), or a stable loss turned non-finite at
      once without mixed precision (one bad batch);
    * the learning rate - the loss grew (at least doubled) or the gradient norm exploded (10x its median) over the
      recent steps, or the loss was finite but the gradient was not;
    * bf16 - mixed precision is on and none of the above: a stable run that overflowed / lost precision in bf16.
- `assert_finite_state_dict` runs before any checkpoint or model write and names the first bad tensor, so no
  non-finite weights are ever written (the previous checkpoint stays the newest).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import DataError

__all__ = [
    "DivergenceError",
    "NonFiniteGuard",
    "NonFiniteWeightsError",
    "StepStats",
    "assert_finite_state_dict",
    "check_finite",
    "check_step",
    "diagnose",
]

EARLY_STEPS = 3
"""A non-finite loss within this many finite steps of the start points at the data, not the optimisation."""
LOSS_GROWTH = 2.0
"""The loss counts as having grown when its last value is this many times the window's early median."""
GRAD_EXPLOSION = 10.0
"""The gradient norm counts as exploding when its last value is this many times the window's median."""


class DivergenceError(DataError):
    """Training produced a non-finite loss or gradient; the message names the most likely cause and the fix."""

    def __init__(self, message: str, step: int | None = None, cause: str | None = None):
        super().__init__(message)
        self.step = step
        self.cause = cause  # "data" | "lr" | "bf16" | None


class NonFiniteWeightsError(DivergenceError):
    """A state dict about to be written holds NaN/inf; nothing was written."""


class StepStats(NamedTuple):
    """One finite optimizer step remembered for the diagnosis."""

    step: int
    loss: float
    grad_norm: float | None


def _all_finite_flag(values: Sequence[torch.Tensor | float | None]) -> torch.Tensor:
    """0-d int32 tensor: 1 when some value is non-finite, else 0 (stays on the values' device: no sync here)."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    bad = torch.zeros((), dtype=torch.int32, device=device)
    for v in values:
        if v is None:
            continue
        if isinstance(v, torch.Tensor):
            bad = bad | (~torch.isfinite(v.detach())).any().to(device=device, dtype=torch.int32)
        elif not math.isfinite(float(v)):
            bad = bad | 1
    return bad


def check_finite(loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None, dist: Any = None) -> bool:
    """True when `loss` and `grad_norm` are finite on EVERY rank (one all-reduce MAX of one int; no-op alone).

    Parameters
    ----------
    loss: this step's loss, a 0-d tensor (any device) or a float.
    grad_norm: the total gradient norm `clip_grad_norm_` returned, or None when it was not computed.
    dist: the run's `DistInfo` (its `device` holds the reduced tensor; nccl needs the GPU) or None.

    Returns
    -------
    False on all ranks as soon as one rank saw NaN/inf.
    """
    return check_step(loss, grad_norm, dist)[0]


def check_step(loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None, dist: Any = None,
               stop: bool = False) -> tuple[bool, bool]:
    """`check_finite` plus a stop request agreed in the same all-reduce: (all finite, any rank asked to stop).

    One collective per optimizer step carries both flags, so the stop check of `interrupts` costs nothing extra.
    """
    import torch.distributed as tdist

    bad = _all_finite_flag([loss, grad_norm])
    flags = torch.stack([bad, torch.tensor(1 if stop else 0, dtype=torch.int32, device=bad.device)])  # (2,)
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        device = getattr(dist, "device", None) or bad.device
        flags = flags.to(device)
        tdist.all_reduce(flags, op=tdist.ReduceOp.MAX)
    bad_any, stop_any = flags.tolist()
    return not bad_any, bool(stop_any)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def diagnose(history: Sequence[StepStats], amp: bool, step: int, loss: float, grad_norm: float | None = None, *,
             data_extremes: str | None = None, lr_key: str = "training.lr", amp_key: str = "training.amp",
             clip_key: str = "training.clip_grad_norm") -> str:
    """The most likely reason a step went non-finite, as one sentence that names the setting to change.

    Parameters
    ----------
    history: the recent FINITE steps, oldest first (the guard keeps the last 50).
    amp: whether bf16 mixed precision is on.
    step: the failing optimizer step (1-based).
    loss / grad_norm: the failing step's values (NaN/inf allowed; grad_norm None when not computed).
    data_extremes: what the data check flagged (e.g. "volume up to 3.1e+38 in a.csv"), or None.
    lr_key / amp_key / clip_key: the settings to name (the stage's own keys where it overrides them).

    Returns
    -------
    A string starting "most likely a data value", "most likely the learning rate" or "most likely bf16".
    """
    if data_extremes:
        return (f"most likely a data value: the data check reported extreme values ({data_extremes}); "
                "correct or remove them in the data")
    loss_bad = not math.isfinite(loss)
    if loss_bad and len(history) < EARLY_STEPS:
        return (f"most likely a data value: the loss was non-finite in the forward pass at step {step}, before "
                f"{EARLY_STEPS} finite steps (the weights are still the pretrained ones), so an input window holds "
                "a NaN/inf or extreme value; check the data" + (f" (or turn off bf16 with {amp_key}=none)" if amp
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
                f"with mixed precision on; set {amp_key}=none")
    return (f"most likely a data value: the loss was stable (about {_fmt(last)}) and turned non-finite at once at "
            f"step {step}, which points at one bad batch (a NaN/inf or extreme candle); check the data")


class NonFiniteGuard:
    """Per-run state of the guard: remembers recent finite steps and raises `DivergenceError` on a bad one.

    Parameters
    ----------
    amp: whether bf16 mixed precision is on (for the diagnosis).
    dist: the run's `DistInfo` or None.
    data_extremes: what the data check flagged, or None.
    window: how many recent steps to remember.
    keys: overrides of the setting names quoted (`lr_key`, `amp_key`, `clip_key`), e.g. the stage's lr key.
    """

    def __init__(self, *, amp: bool, dist: Any = None, data_extremes: str | None = None, window: int = 50,
                 **keys: str):
        self.amp, self.dist, self.data_extremes = amp, dist, data_extremes
        self.history: deque[StepStats] = deque(maxlen=window)
        self.keys = keys

    def check(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None,
              stop: bool = False) -> bool:
        """Call once per optimizer step before `optimizer.step()`; raises `DivergenceError` on every rank if any
        rank's loss or gradient norm is non-finite. `stop`: this rank's stop request (interrupts.stop_requested());
        returns whether any rank asked to stop (agreed in the same all-reduce)."""
        finite, stop_any = check_step(loss, grad_norm, self.dist, stop)
        loss_f = float(loss)
        norm_f = None if grad_norm is None else float(grad_norm)
        if finite:
            self.history.append(StepStats(step, loss_f, norm_f))
            return stop_any
        text = diagnose(self.history, self.amp, step, loss_f, norm_f, data_extremes=self.data_extremes, **self.keys)
        here_finite = math.isfinite(loss_f) and (norm_f is None or math.isfinite(norm_f))
        local = " on another rank" if here_finite else ""
        cause = text.split(":", 1)[0].removeprefix("most likely ")
        cause = {"a data value": "data", "the learning rate": "lr", "bf16": "bf16"}.get(cause)
        raise DivergenceError(f"training diverged at step {step}{local} (loss {_fmt(loss_f)}, gradient norm "
                              f"{_fmt(norm_f)}); nothing of this step was applied: {text}", step=step, cause=cause)


def _float_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of every floating tensor inside nested dicts/lists, in insertion order."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield prefix or "<tensor>", obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _float_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _float_tensors(v, f"{prefix}[{i}]" if prefix else f"[{i}]")


def assert_finite_state_dict(state_dict: Any, what: str) -> None:
    """Raise `NonFiniteWeightsError` naming the first tensor holding NaN/inf; call it before writing `what`.

    Parameters
    ----------
    state_dict: a model state dict or a whole checkpoint dict (nested dicts/lists of tensors are searched).
    what: what was about to be written, e.g. "checkpoints/step-00000123.pt", for the message.
    """
    named = list(_float_tensors(state_dict))
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
