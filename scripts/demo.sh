#!/usr/bin/env bash
# The README's first command: finetune Kronos on CSV candles end to end, on CPU, in a few minutes.
#
#   bash scripts/demo.sh
#
# 1. sets up .venv (scripts/setup_env.sh; skipped when it is already up to date),
# 2. writes synthetic 5-minute candles, one CSV per symbol, into data/generated/csv_demo_5min/ (gitignored),
# 3. trains a tiny tokenizer, then a tiny predictor, from scratch (configs/csv_demo.yaml; nothing is downloaded),
# 4. forecasts the held-out test candles with model.KronosPredictor and prints close MAE, direction accuracy
#    and how many generated candles break high >= max(open, close), low <= min(open, close), volume >= 0.
# Outputs: outputs/csv_demo/{tokenizer,basemodel}/ (best_model/, loss_curve.png, metrics.jsonl, run_info.json)
# and outputs/csv_demo/forecast/ (forecast_vs_actual.png, forecast.csv, metrics.json).
# Environment: SKIP_SETUP=1 skips step 1 and PYTHON_BIN picks the interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/csv_demo.yaml
DATA=data/generated/csv_demo_5min
PY=${PYTHON_BIN:-.venv/bin/python}
# Tiny models gain nothing from intra-op threads, and threads fighting over a busy CPU make each step 10x slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

start=$(date +%s)
if [ "${SKIP_SETUP:-0}" != "1" ]; then
  bash scripts/setup_env.sh
fi

echo "[demo] synthetic data -> $DATA"
"$PY" scripts/make_synthetic_data.py --out "$DATA" --n-series 4 --n-bars 3000 --freq 5min --seed 0

echo "[demo] training tokenizer, then predictor ($CONFIG)"
"$PY" finetune_csv/train_sequential.py --config "$CONFIG" --set data.path="$DATA"

echo "[demo] forecasting the held-out test split"
"$PY" finetune_csv/forecast.py --config "$CONFIG" --set data.path="$DATA"

echo "[demo] loss curves: outputs/csv_demo/tokenizer/loss_curve.png, outputs/csv_demo/basemodel/loss_curve.png"
echo "[demo] forecast:    outputs/csv_demo/forecast/forecast_vs_actual.png"
echo "[demo] finished in $(( $(date +%s) - start )) s"
