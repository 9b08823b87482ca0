"""The project's benchmarks (`kronos benchmark`): run them and print their tables; each module is also a command of
its own (`python -m finetune.benchmarks.generation --help`). Results and what made them fast: docs/benchmarks.md.

    kronos benchmark                       # all of them (several minutes on 2 CPU cores)
    kronos benchmark generation csv_data
    kronos benchmark csv_data -- --series 2 --bars 600     # options after -- go to the one benchmark named
"""

from __future__ import annotations

import subprocess
import sys
import time

BENCHES = {
    "generation": ["generation"],  # forecast: eager cached vs static step (+ CUDA graph), 3 workloads
    "csv_data": ["data", "csv"],  # CSV window dataset vs per-sample pandas .iloc
    "qlib_data": ["data", "qlib"],  # Qlib window dataset vs per-sample pandas
    "train_step": ["train_step"],  # engine train step vs plain fp32 step (bf16 on CUDA)
}  # `python -m finetune.benchmarks.data store` (100M rows, ~13 GB of disk) runs on its own


def main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    names, options = argv[:cut] or list(BENCHES), argv[cut + 1 :]
    if any(n in ("-h", "--help") for n in names):
        print(f"usage: kronos benchmark [NAME ...] [-- OPTION ...]\n\n{__doc__}\nNAME: {', '.join(BENCHES)} (all)")
        return 0
    unknown = [n for n in names if n not in BENCHES]
    if unknown or (options and len(names) != 1):
        print(
            f"error: unknown benchmark(s) {unknown}; choose from {list(BENCHES)}"
            if unknown
            else "error: options after -- are for one benchmark: name exactly one",
            file=sys.stderr,
        )
        return 2
    failed = []
    for name in names:
        module, *args = BENCHES[name]
        print(f"\n=== {name} (python -m finetune.benchmarks.{' '.join(BENCHES[name])})", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", f"finetune.benchmarks.{module}", *args, *options])
        print(f"=== {name}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    return 1 if failed else 0
