"""Forward-return labels that follow the trade, computed by Qlib on the market calendar.

Qlib's `TopkDropoutStrategy` trades a score dated t on day t+1 at the deal price, so the return the position earns
over h days is price(t+1+h) / price(t+1) - 1 (h = 1: Qlib's Alpha158 label `Ref($close, -2)/Ref($close, -1) - 1`).
A label on close(t+1) / close(t) would mix in the overnight move that no order placed on the score can capture.

The expressions run through `D.features`, so `Ref` moves along the market calendar as stored: a day missing from the
store or suspended there (NaN $close) makes the label NaN rather than reaching over the gap.

    labels = forward_labels("csi300", "2024-01-01", "2024-06-30", deal_price="close", horizons=5)
    # DataFrame, index (datetime, instrument), columns label_1..label_5
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

DEAL_PRICES = ("close", "open", "vwap")


def _price_field(deal_price: str) -> str:
    name = deal_price.lstrip("$").lower()
    if name not in DEAL_PRICES:
        raise ValueError(f"deal_price={deal_price!r} is not supported; choose one of {list(DEAL_PRICES)} "
                         "(backtest.deal_price)")
    return f"${name}"


def label_expression(deal_price: str = "close", horizon: int = 1) -> str:
    """Qlib expression of the `horizon`-day return of a position entered at t+1 at `deal_price`.

    Parameters
    ----------
    deal_price : "close", "open" or "vwap" (a leading "$" is accepted).
    horizon : h >= 1 trading days held.

    Returns
    -------
    e.g. "Ref($close, -2) / Ref($close, -1) - 1" for close, h = 1.
    """
    if not isinstance(horizon, int) or horizon < 1:
        raise ValueError(f"horizon={horizon!r} must be an integer >= 1")
    field = _price_field(deal_price)
    return f"Ref({field}, -{horizon + 1}) / Ref({field}, -1) - 1"


def label_columns(horizons: int | Sequence[int]) -> list[str]:
    """Column names label_<h> for horizons 1..P (an int P) or the given list."""
    return [f"label_{h}" for h in _horizons(horizons)]


def _horizons(horizons: int | Sequence[int]) -> list[int]:
    hs = list(range(1, horizons + 1)) if isinstance(horizons, int) else [int(h) for h in horizons]
    if not hs or min(hs) < 1:
        raise ValueError(f"horizons={horizons!r}: need at least one horizon, each >= 1")
    return hs


def forward_labels(instruments, start_time, end_time, deal_price: str = "close",
                   horizons: int | Sequence[int] = 1, freq: str = "day") -> pd.DataFrame:
    """Trade-consistent forward returns for every instrument and day, from the initialised Qlib provider.

    Parameters
    ----------
    instruments : a market name ("csi300"), a Qlib instruments config (`D.instruments(...)`) or a list of symbols.
    start_time, end_time : label dates (the dates of the scores they are compared with); Qlib reads the days after
        `end_time` the expressions need by itself.
    deal_price : the backtest's deal price; horizons : P (-> 1..P) or a list of h.

    Returns
    -------
    DataFrame, index (datetime, instrument), columns label_<h>, float; NaN where a needed day is missing or
    suspended, or lies beyond the store's last day.
    """
    from qlib.data import (
        D,  # Qlib only where labels are computed; the package itself does not need it
    )

    hs = _horizons(horizons)
    if isinstance(instruments, str):
        instruments = D.instruments(instruments)
    exprs = [label_expression(deal_price, h) for h in hs]
    frame = D.features(instruments, exprs, start_time=start_time, end_time=end_time, freq=freq)
    frame.columns = label_columns(hs)
    return frame.swaplevel().sort_index() if frame.index.names[0] == "instrument" else frame.sort_index()
