"""Baseline cross-sectional signals from the same Qlib store as the model's scores.

A forecast signal is only interesting if it beats what the price history says by itself:
- momentum: the return over the last `window` days, close(t) / close(t - window) - 1 (winners keep winning);
- short-term reversal: minus the return over the last `window` days (last week's losers bounce back).
Both are dated t and use data up to t's close, like the model's scores, so they meet the same labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass
class BaselineSettings:
    """Look-back windows of the baseline signals, in trading days."""

    momentum_window: int = 20
    """Momentum: return over this many days."""
    reversal_window: int = 5
    """Short-term reversal: minus the return over this many days."""


def baseline_expressions(settings: BaselineSettings | None = None) -> dict[str, str]:
    """{signal name: Qlib expression}; the expressions step along the stored calendar (NaN across a suspension)."""
    s = settings or BaselineSettings()
    for key in ("momentum_window", "reversal_window"):
        value = getattr(s, key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")
    return {"momentum": f"$close / Ref($close, {s.momentum_window}) - 1",
            "reversal": f"Ref($close, {s.reversal_window}) / $close - 1"}


def baseline_signals(instruments, start_time, end_time, settings: BaselineSettings | None = None,
                     freq: str = "day") -> pd.DataFrame:
    """Baseline scores for every instrument and day from the initialised Qlib provider.

    Parameters
    ----------
    instruments : market name, Qlib instruments config or list of symbols; start_time, end_time : score dates
        (Qlib reads the look-back days before `start_time` by itself).

    Returns
    -------
    DataFrame, index (datetime, instrument), columns momentum, reversal.
    """
    from qlib.data import D

    exprs = baseline_expressions(settings)
    if isinstance(instruments, str):
        instruments = D.instruments(instruments)
    frame = D.features(instruments, list(exprs.values()), start_time=start_time, end_time=end_time, freq=freq)
    frame.columns = list(exprs)
    return frame.swaplevel().sort_index()
