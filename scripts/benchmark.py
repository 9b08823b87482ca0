"""Run every benchmark of the project and print their tables (each is also a script of its own).

    python scripts/benchmark.py            # all of them (several minutes on 2 CPU cores)
    python scripts/benchmark.py generation csv_data
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
BENCHES = {
    "generation": ["bench_generation.py"],     # forecast: eager cached vs static step (+ CUDA graph), 3 workloads
    "csv_data": ["bench_data.py", "csv"],      # CSV window dataset vs per-sample pandas .iloc
    "qlib_data": ["bench_data.py", "qlib"],    # Qlib window dataset vs per-sample pandas
    "train_step": ["bench_train_step.py"],     # engine train step vs plain fp32 step (bf16 on CUDA)
}  # `bench_data.py store` (100M rows, ~13 GB of disk) runs on its own


def main(argv: list[str]) -> int:
    names = argv or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        script, *args = BENCHES[name]
        print(f"\n=== {name} ({' '.join(BENCHES[name])})", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(SCRIPTS / script), *args])
        print(f"=== {name}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
