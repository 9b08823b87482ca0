"""`kronos finetune` on the demo config without OMP_NUM_THREADS (the engine chooses the threads) vs with
OMP_NUM_THREADS=1, alternating runs so both see the same machine load; prints each time and the ratio.

    python scripts/bench_threads.py [--rounds 3] [--epochs 1]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=1, help="predictor epochs per run (the demo uses 3)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        subprocess.run([sys.executable, str(ROOT / "scripts/make_synthetic_data.py"), "--out", str(data),
                        "--n-series", "4", "--n-bars", "3000", "--freq", "5min", "--seed", "0"], check=True,
                       capture_output=True)
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        times: dict[str, list[float]] = {"engine": [], "OMP_NUM_THREADS=1": []}
        for r in range(args.rounds):
            for name, env in (("engine", base), ("OMP_NUM_THREADS=1", {**base, "OMP_NUM_THREADS": "1"})):
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "finetune.cli", "finetune", "--config",
                                str(ROOT / "configs/csv_demo.yaml"), "--set", f"data.path={data}",
                                "--set", f"paths.base_dir={tmp}/{name}{r}", "--set",
                                f"predictor_training.epochs={args.epochs}"], check=True, env=env, cwd=ROOT,
                               capture_output=True)
                times[name].append(time.perf_counter() - t0)
                print(f"round {r}: {name:18s} {times[name][-1]:6.1f} s", flush=True)
    engine, one = (sum(t) / len(t) for t in times.values())
    print(f"mean: engine {engine:.1f} s, OMP_NUM_THREADS=1 {one:.1f} s, ratio {engine / one:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
