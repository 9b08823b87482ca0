#!/usr/bin/env bash
# `kronos finetune` on the demo config without OMP_NUM_THREADS (the engine chooses the threads) vs with
# OMP_NUM_THREADS=1, alternating runs so both see the same machine load; prints each time and the mean ratio.
#   bash scripts/bench_threads.sh [ROUNDS=3] [PREDICTOR_EPOCHS=1]          (docs/benchmarks.md has the numbers)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3} EPOCHS=${2:-1} PY=${PYTHON_BIN:-.venv/bin/python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" scripts/make_synthetic_data.py --out "$TMP/data" --n-series 4 --n-bars 3000 --freq 5min --seed 0 >/dev/null
run() {  # run NAME [ENV...]: seconds of one finetune
  local t0=$SECONDS
  env -u OMP_NUM_THREADS "${@:2}" "$PY" -m finetune.cli finetune --config configs/csv_demo.yaml \
    --set data.path="$TMP/data" --set paths.base_dir="$TMP/$1$r" --set predictor_training.epochs="$EPOCHS" \
    >/dev/null 2>&1
  echo $(( SECONDS - t0 ))
}
engine=0 one=0
for r in $(seq "$ROUNDS"); do
  e=$(run engine) o=$(run one OMP_NUM_THREADS=1)
  echo "round $r: engine ${e} s, OMP_NUM_THREADS=1 ${o} s"
  engine=$(( engine + e )) one=$(( one + o ))
done
echo "total: engine ${engine} s, OMP_NUM_THREADS=1 ${one} s, ratio $(awk "BEGIN {printf \"%.2f\", $engine / $one}")"
