"""Build a Qlib provider folder (daily bars) from per-symbol CSVs, or from synthetic daily data in one command.

    python scripts/build_qlib_data.py --csv-dir data/daily_csv --out data/qlib_cn \
        --universe csi300 --benchmark SH000300
    python scripts/build_qlib_data.py --synthetic 20 --out data/qlib_demo  # demo store, 2018-01-02..2025-06-30

CSV columns: timestamps, open, high, low, close, volume and optionally amount (derived as volume * mean(open, high,
low, close) when absent), matched in any case with the usual aliases (Date, Datetime, vol, turnover, ...);
--columns timestamps=Trade Date,close=Adj Close maps other names. The symbol is the file stem, upper-cased.
Days with zero volume or no close are written as suspended (NaN in every field); the count per symbol is printed.
--membership FILE (CSV symbol,start,end; several rows per symbol allowed) writes the universe point in time, as it
was on each day, instead of every stock over its whole life (which biases a backtest towards survivors).
Without <BENCHMARK>.csv the benchmark is an equal-weighted index of the universe, and a warning says so.
Read it back with `qlib.init(provider_uri=OUT, region="cn")`; see finetune/qlib_builder.py for the layout.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from finetune.qlib_builder import build_qlib_provider, load_csv_folder
from finetune.synthetic import generate_ohlcv
from finetune.utils.errors import setup_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--csv-dir", help="folder of daily <SYMBOL>.csv files")
    source.add_argument("--synthetic", type=int, metavar="N", help="generate N synthetic daily series instead")
    p.add_argument("--out", required=True, help="provider folder to create")
    p.add_argument("--universe", default="csi300", help="market name: instruments/<universe>.txt")
    p.add_argument("--benchmark", default="SH000300",
                   help="benchmark symbol; a CSV of that name is used as is, else an equal-weighted index is built")
    p.add_argument("--membership", help="CSV symbol,start,end: point-in-time universe membership")
    p.add_argument("--columns", default="", metavar="FIELD=NAME,...",
                   help="map candle fields to your column names, e.g. timestamps=Trade Date,volume=Vol")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    synth = p.add_argument_group("synthetic data (with --synthetic)")
    synth.add_argument("--start", default="2018-01-02", help="first day")
    synth.add_argument("--end", default="2025-06-30", help="last day")
    synth.add_argument("--seed", type=int, default=0, help="same seed, same data")
    args = p.parse_args(argv)
    if args.synthetic is not None and args.synthetic < 1:
        p.error("--synthetic N needs N >= 1")
    pairs = [item.split("=", 1) for item in args.columns.split(",") if item.strip()]
    if any(len(pair) != 2 for pair in pairs):
        p.error(f"--columns {args.columns!r}: expected FIELD=NAME pairs separated by commas")
    args.columns = {k.strip(): v.strip() for k, v in pairs}
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if args.csv_dir is not None:
                frames = load_csv_folder(args.csv_dir)
            else:
                frames = generate_ohlcv(args.synthetic, freq="1D", start=args.start, end=args.end, seed=args.seed)
            out = build_qlib_provider(frames, args.out, universe=args.universe, benchmark=args.benchmark,
                                      overwrite=args.overwrite, membership=args.membership,
                                      columns=args.columns or None)
            print(f"built Qlib provider {out}: {len(frames)} symbols, universe {args.universe}, benchmark "
                  f"{args.benchmark}")
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
    except (ValueError, FileNotFoundError, FileExistsError) as err:  # bad input: the message, not a traceback
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
