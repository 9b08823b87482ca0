#!/usr/bin/env bash
# The README's first command: finetune a pretrained Kronos pair on CSV candles and show whether it helped, on CPU.
#
#   bash scripts/demo.sh
#
# 1. sets up .venv (scripts/setup_env.sh; skipped when it is already up to date),
# 2. writes the demo market: synthetic 5-minute candles, one CSV per symbol, into data/generated/csv_demo_5min/,
# 3. finetunes the small pretrained predictor in checkpoints/demo-pretrained/ on it (configs/csv_demo.yaml; the
#    pretrained tokenizer is kept; nothing is downloaded),
# 4. forecasts EVERY non-overlapping held-out test window with the finetuned model and with the model it started
#    from (zero-shot), 32 sample paths each, and prints one table: MAE / MASE / CRPS / WQL / 50% and 80% coverage /
#    direction, the ensemble of both, persistence / empirical / seasonal-naive baselines, paired differences with
#    95% date-block bootstrap intervals, the calibrated bands' coverage and the share of invalid sampled candles,
# 5. forecasts the 16 candles after the end of the data (--future).
# Outputs: outputs/csv_demo/basemodel/ (best_model/, loss_curve.png, metrics.jsonl, run_info.json),
# outputs/csv_demo/forecast/ (metrics.json, forecast.csv, forecast_vs_actual.png) and outputs/csv_demo/future/.
# Environment: SKIP_SETUP=1 skips step 1 and PYTHON_BIN picks the interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/csv_demo.yaml
DATA=data/generated/csv_demo_5min
PY=${PYTHON_BIN:-.venv/bin/python}
# Tiny models gain nothing from intra-op threads, and threads fighting over a busy CPU make each step 10x slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

start=$(date +%s)
step() {  # step NAME: prints the time the previous step took
  local now
  now=$(date +%s)
  [ -n "${step_name:-}" ] && echo "[demo] ${step_name} took $(( now - step_start )) s"
  step_name=$1
  step_start=$now
}

if [ "${SKIP_SETUP:-0}" != "1" ]; then
  step "setup"
  bash scripts/setup_env.sh
fi

step "synthetic data"
echo "[demo] synthetic data -> $DATA"
"$PY" scripts/make_synthetic_data.py --out "$DATA" --n-series 4 --n-bars 3000 --freq 5min --seed 0

step "finetuning"
echo "[demo] finetuning checkpoints/demo-pretrained on it ($CONFIG)"
"$PY" finetune_csv/train_sequential.py --config "$CONFIG" --set data.path="$DATA"

step "held-out evaluation"
echo "[demo] zero-shot vs finetuned on every held-out test window"
"$PY" finetune_csv/forecast.py --config "$CONFIG" --set data.path="$DATA"

step "future forecast"
echo "[demo] forecasting past the end of the data"
"$PY" finetune_csv/forecast.py --config "$CONFIG" --set data.path="$DATA" --future
step "done"

echo "[demo] loss curve: outputs/csv_demo/basemodel/loss_curve.png"
echo "[demo] held-out:   outputs/csv_demo/forecast/forecast_vs_actual.png (metrics.json holds every number)"
echo "[demo] future:     outputs/csv_demo/future/forecast.png, forecast.csv"
echo "[demo] the page:   outputs/csv_demo/forecast/report.html (and future/report.html): open it in a browser"
echo "[demo] finished in $(( $(date +%s) - start )) s"
