"""Write a synthetic OHLCV dataset, one CSV per symbol (see finetune/synthetic.py for the market model).

    python scripts/make_synthetic_data.py --out data/synthetic_5min --n-series 8 --n-bars 20000 --freq 5min
    python scripts/make_synthetic_data.py --out data/synthetic_daily --freq 1D --start 2018-01-02 --end 2023-12-29
"""

from __future__ import annotations

import argparse

from finetune.synthetic import FREQ_MINUTES, generate_ohlcv, write_csv_folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write <symbol>.csv files into")
    p.add_argument("--n-series", type=int, default=8, help="number of symbols")
    p.add_argument("--n-bars", type=int, default=None, help="bars per symbol (default 20000 unless --end is given)")
    p.add_argument("--end", default=None, help="last day (YYYY-MM-DD) instead of --n-bars")
    p.add_argument("--freq", default="5min", choices=list(FREQ_MINUTES), help="bar length")
    p.add_argument("--start", default="2024-01-02", help="first day (YYYY-MM-DD)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same data")
    p.add_argument("--intraday-drift", type=float, default=0.0,
                   help="predictable time-of-day drift in bar volatilities (the walk-forward demo uses 0.5; 0 = none)")
    args = p.parse_args(argv)
    if args.n_bars is not None and args.end is not None:
        p.error("give --n-bars or --end, not both")
    if args.n_bars is None and args.end is None:
        args.n_bars = 20_000
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        frames = generate_ohlcv(args.n_series, args.n_bars, freq=args.freq, start=args.start, seed=args.seed,
                                end=args.end, intraday_drift=args.intraday_drift)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    paths = write_csv_folder(frames, args.out)
    n_rows = len(next(iter(frames.values())))
    print(f"wrote {len(paths)} CSVs x {n_rows} bars ({args.freq}) to {args.out}")


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
