"""PNG plots of CSV forecasts: close of the context tail, the median forecast and its 10-90 / 25-75 quantile bands.

Bars are drawn at consecutive x positions and the tick labels are the bars' real timestamps: markets close at night
and at weekends, and a time axis would draw every closed stretch as a long flat line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

BANDS = ((0.10, 0.90, 0.18), (0.25, 0.75, 0.35))  # (low quantile, high quantile, fill alpha)


@dataclass
class Panel:
    """What one plot panel shows."""

    title: str
    """Panel title."""
    past_ts: pd.DatetimeIndex
    """(T,) timestamps of the context tail."""
    past_close: np.ndarray
    """(T,) close of the context tail."""
    future_ts: pd.DatetimeIndex
    """(P,) timestamps of the forecast bars."""
    paths_close: np.ndarray
    """(S, P) sampled close paths."""
    actual_close: np.ndarray | None = None
    """(P,) realised close (held-out windows), None for a forecast of the future."""


def _tick_labels(stamps: pd.DatetimeIndex, n_ticks: int = 6) -> tuple[np.ndarray, list[str]]:
    """Up to `n_ticks` evenly spread positions and their date labels (with the time for intraday bars)."""
    pos = np.unique(np.linspace(0, len(stamps) - 1, min(n_ticks, len(stamps))).round().astype(int))
    intraday = len(stamps) > 1 and (np.diff(stamps.asi8).min() < 86_400 * 10**9)
    fmt = "%m-%d %H:%M" if intraday else "%Y-%m-%d"
    return pos, [stamps[i].strftime(fmt) for i in pos]


def plot_panels(panels: list[Panel], png: Path) -> Path:
    """Draw one panel per entry into `png` (written whole: matplotlib saves to a temporary name first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.8 * len(panels)), dpi=100, squeeze=False)
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
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(png)
    return png
