"""Figures, written whole (`save_figure`: a temporary name, then renamed), the loss curve and forecast panels, and
the bar-time text that labels them and the reports; matplotlib is imported inside the functions (a run without it
still trains). Details: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from model.fileio import atomic_write


def stamp_text(stamp: Any, stamps: pd.DatetimeIndex | None = None, intraday_fmt: str | None = None) -> str:
    """A bar time for people: the date alone (`2017-04-28`) for a daily bar, else with the time of day.

    Daily means: `stamps` (the bar's series) at least a day apart; without `stamps`, the stamp at midnight.
    `intraday_fmt`: strftime format of an intraday bar (None = full precision, `2017-04-28 09:35:00`)."""
    ts = pd.Timestamp(stamp)
    if stamps is None:
        intraday = ts != ts.normalize()
    else:
        intraday = len(stamps) > 1 and np.diff(stamps.values).min() < np.timedelta64(1, "D")  # any time unit
    if not intraday:
        return f"{ts:%Y-%m-%d}"
    return str(ts) if intraday_fmt is None else ts.strftime(intraday_fmt)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only: no display is needed or opened)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, png: str | Path, **savefig: Any) -> Path:
    """Lay out, write (whole: to a temporary name first) and close a pyplot figure; `savefig`: e.g. dpi,
    bbox_inches."""
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(png, lambda p: fig.savefig(p, format="png", **savefig))
    pyplot().close(fig)
    return png


def loss_plot_title(stage: str, source: str | None) -> str:
    """"<stage>: finetuned from <source>" (source = the pretrained model's id or path) or "<stage>: trained from
    scratch" (source None)."""
    return f"{stage}: trained from scratch" if source is None else f"{stage}: finetuned from {source}"


def best_val_record(records: Iterable[dict[str, Any]], best_epoch: int | None = None) -> dict[str, Any] | None:
    """The validation record of `best_epoch` (the last one logged for it), or with None the one with the lowest
    finite val_loss (the earliest on ties); None when there is no such record."""
    val = [r for r in records if r.get("kind") == "val" and _finite(r.get("val_loss"))]
    if best_epoch is not None:
        of_epoch = [r for r in val if r.get("epoch") == best_epoch]
        return of_epoch[-1] if of_epoch else None
    return min(val, key=lambda r: r["val_loss"]) if val else None


def loss_curve_figure(records: Iterable[dict[str, Any]], title: str = "", best_epoch: int | None = None,
                      smoothing: float = 0.9):
    """The loss figure against the optimizer step: train loss (raw and a debiased EMA of weight `smoothing`),
    validation loss per epoch (epoch 0 = the starting model) with the best epoch starred (gid "best_epoch"; None =
    the lowest, else the trainer's, which honours min_delta); the learning rate below (log scale)."""
    # no pyplot: no global backend or figure registry involved
    from matplotlib.figure import Figure

    records = sorted(records, key=lambda r: r.get("step", 0))  # sorted() is stable: same-step order kept
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and _finite(r.get("loss"))]
    lr = [(r["step"], r["lr"]) for r in records if r.get("kind") == "train" and _finite(r.get("lr"))]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "val" and _finite(r.get("val_loss"))]

    fig = Figure(figsize=(8, 6), dpi=100)
    ax, ax_lr = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="C0", alpha=0.3, linewidth=0.8, label="train loss (raw)")
        # pandas' adjust=True weighting is TensorBoard's debiased EMA (the first points are not pulled toward 0)
        ema = pd.Series(losses).ewm(alpha=1 - smoothing).mean()
        ax.plot(steps, ema, color="C0", linewidth=1.5, label="train loss (smoothed)")
    if val:
        ax.plot(*zip(*val), "o-", color="C1", linewidth=1.5, label="validation loss (per epoch)")
    best = best_val_record(records, best_epoch)
    if best is not None:
        ax.plot([best["step"]], [best["val_loss"]], linestyle="none", marker="*", markersize=16, color="C3",
                zorder=5, gid="best_epoch", label=f"best: epoch {best.get('epoch')} (val {best['val_loss']:.4g})")
        ax_lr.axvline(best["step"], color="C3", linestyle=":", linewidth=1)
    # A checkpoint-selection metric (training.select_by: crps / ic -> "metric_<name>" in the val records) on its own
    # axis: the curve the best epoch was chosen by.
    metric_keys = sorted({k for r in records if r.get("kind") == "val" for k in r if k.startswith("metric_")})
    handles = []
    if metric_keys:
        ax_metric = ax.twinx()
        for i, key in enumerate(metric_keys):
            points = [(r["step"], r[key]) for r in records if r.get("kind") == "val" and _finite(r.get(key))]
            if points:
                handles += ax_metric.plot(*zip(*points), "s--", color=f"C{4 + i}", linewidth=1.2, gid=key,
                                          label=f"validation {key.removeprefix('metric_')} (per epoch)")
        ax_metric.set_ylabel(", ".join(k.removeprefix("metric_") for k in metric_keys))
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or val:
        lines, labels = ax.get_legend_handles_labels()
        ax.legend(lines + handles, labels + [h.get_label() for h in handles], loc="upper right")
    else:
        ax.text(0.5, 0.5, "no finite losses logged", ha="center", va="center", transform=ax.transAxes)

    if lr:
        ax_lr.plot(*zip(*lr), color="C2", linewidth=1.2)
        if all(v > 0 for _, v in lr):
            ax_lr.set_yscale("log")  # OneCycle spans ~4 decades; linear would hide warmup and the tail
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_loss_curves(records: Iterable[dict[str, Any]], png_path: str | Path, title: str = "",
                     best_epoch: int | None = None) -> Path | None:
    """Write `loss_curve_figure(records, title, best_epoch)` to `png_path` (atomically: no torn PNG on a crash);
    None (and a warning) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        warnings.warn("matplotlib is not installed; no loss_curve.png written", stacklevel=2)
        return None
    fig = loss_curve_figure(records, title=title, best_epoch=best_epoch)
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(png_path, lambda p: fig.savefig(p, format="png"))


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


BANDS = ((0.10, 0.90, 0.18), (0.25, 0.75, 0.35))  # (low quantile, high quantile, fill alpha)


@dataclass
class Panel:
    """What one plot panel shows."""

    title: str  # Panel title.
    past_ts: pd.DatetimeIndex  # (T,) timestamps of the context tail.
    past_close: np.ndarray  # (T,) close of the context tail.
    future_ts: pd.DatetimeIndex  # (P,) timestamps of the forecast bars.
    paths_close: np.ndarray  # (S, P) sampled close paths.
    actual_close: np.ndarray | None = None  # (P,) realised close (held-out windows), None for a forecast of the future.


def _tick_labels(stamps: pd.DatetimeIndex, n_ticks: int = 6) -> tuple[np.ndarray, list[str]]:
    """Up to `n_ticks` evenly spread positions and their date labels (with the time for intraday bars)."""
    pos = np.unique(np.linspace(0, len(stamps) - 1, min(n_ticks, len(stamps))).round().astype(int))
    return pos, [stamp_text(stamps[i], stamps, "%m-%d %H:%M") for i in pos]


def plot_panels(panels: list[Panel], png: Path) -> Path:
    """Draw one panel per entry into `png`."""
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(10.5, 2.8 * len(panels)), dpi=100, squeeze=False)
    for ax, p in zip(axes[:, 0], panels):
        n_past, horizon = len(p.past_close), p.paths_close.shape[1]
        x_past, x_future = np.arange(n_past), np.arange(n_past - 1, n_past + horizon)  # future starts at last close
        last = p.past_close[-1]
        ax.plot(x_past, p.past_close, color="0.4", label="context")
        for lo, hi, alpha in BANDS:
            q = np.quantile(p.paths_close, [lo, hi], axis=0)  # (2, P)
            ax.fill_between(x_future, np.r_[last, q[0]], np.r_[last, q[1]], color="tab:orange", alpha=alpha,
                            linewidth=0, label=f"{lo:.0%}-{hi:.0%} of samples")
        ax.plot(x_future, np.r_[last, np.median(p.paths_close, axis=0)], color="tab:orange", label="median forecast")
        if p.actual_close is not None:
            ax.plot(x_future, np.r_[last, p.actual_close], color="tab:blue", label="actual")
        ax.axvline(n_past - 0.5, color="0.7", linestyle="--", linewidth=0.8)
        pos, labels = _tick_labels(p.past_ts.append(p.future_ts))
        ax.set_xticks(pos, labels, fontsize=7)
        ax.set_title(p.title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # outside the data
    return save_figure(fig, png)
