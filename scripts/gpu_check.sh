#!/usr/bin/env bash
# One GPU check (issues 23, 27, 34): what this repository promises on a GPU, on a machine with one NVIDIA GPU and
# nothing downloaded, in at most 8 minutes (each step's limit is cut to what is left of them):
#
#   bash scripts/gpu_check.sh            # the check (8 minutes)
#   bash scripts/gpu_check.sh --suite    # then, in a second call: the whole suite beside the GPU (-m "not cuda")
#
#   1. one environment line: GPU, driver, torch, CUDA, NCCL, python; the packages the steps need,
#   2. the `cuda` tests (tests/test_cuda.py, 4 xdist workers on the one GPU: kill / SIGTERM / torchrun restart then
#      resume equal to the uninterrupted run, default-settings resume within two uninterrupted runs' distance and
#      exact with training.deterministic, seeded sampling repeating on the first call, bf16 both CSV stages,
#      forecast cuda vs CPU, LoRA, calibration, a NaN batch never applied by the sync-free guard; and
#      tests/test_model_decode.py's CUDA-graph decode tests),
#   3. the speed targets: finetune.benchmarks.train_step --targets (Kronos-small 64 x 512, Kronos-base 32 x 512,
#      engine defaults, MFU against 790 TFLOP/s) and finetune.benchmarks.generation --full (the four forecast
#      workloads: eager, static, graph, identical greedy output) and --host,
#   4. the CSV demo on the GPU (`kronos finetune`, `kronos forecast`, configs/csv_demo.yaml),
#   5. the Qlib demo trainers under torchrun --standalone --nproc_per_node=1 with DIST_BACKEND=nccl, on the splits in
#      $QLIB_PROCESSED (a folder finetune/qlib_data_preprocess.py wrote with configs/qlib_demo.yaml; 3 MB: build it
#      where pyqlib is installed and carry it), else built here when pyqlib is installed, else SKIP:
#        python scripts/build_qlib_data.py --synthetic 20 --out data/generated/qlib_demo
#        python finetune/qlib_data_preprocess.py --config configs/qlib_demo.yaml  # -> data/generated/qlib_demo_processed
# Then one table (step, status, seconds) and summary.json (every step's status and seconds, every benchmark
# figure, the hardware, each failed test with its traceback); exit 1 when any step failed. Everything goes to
# $GPU_CHECK_OUT, else $OUT/gpu_check (the device tool's folder that comes back), else a new temporary folder.
# Python: .venv/bin/python when there is one, else python3 with this checkout on PYTHONPATH (nothing installed).
# Without a GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1

if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
    echo "a GPU is present (nvidia-smi) but torch cannot use it ($PY):" >&2
    "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" >&2
    exit 1
  fi
  echo "no GPU: nothing to check"
  exit 0
fi

WORK="${GPU_CHECK_OUT:-${OUT:+$OUT/gpu_check}}"
WORK="${WORK:-$(mktemp -d -t kronos-gpu-check.XXXXXX)}"
mkdir -p "$WORK/logs" "$WORK/results"
BUDGET_S=480
names=() statuses=() seconds=() logs=()
log=""

record() {  # record NAME STATUS SECONDS (the step's log: $log)
  names+=("$1") statuses+=("$2") seconds+=("$3") logs+=("$log")
  echo "[gpu-check] $1: $2 ($3 s)"
}

step() {  # step NAME MAX_SECONDS COMMAND...: run it (log: $WORK/logs/<n>.log) under what is left of the budget
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  local left=$(( BUDGET_S - SECONDS ))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then
    log=""
    record "$name" "FAIL (out of time)" 0
    return 1
  fi
  log="$WORK/logs/$(( ${#names[@]} + 1 ))-${name//[^A-Za-z0-9]/_}.log"
  echo "[gpu-check] $name: $* (limit $limit s, log $log)"
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  if (( rc == 124 || rc == 137 )); then
    record "$name" "FAIL (timeout)" $(( SECONDS - start ))
  elif (( rc != 0 )); then
    record "$name" "FAIL (exit $rc)" $(( SECONDS - start ))
    tail -n 15 "$log" | sed 's/^/    /'
  else
    record "$name" "PASS" $(( SECONDS - start ))
  fi
  return $rc
}

start=$SECONDS
env_line=$("$PY" - <<'EOF' 2>&1
import platform, shutil, subprocess
import torch
props = torch.cuda.get_device_properties(0)
driver = "?"
if shutil.which("nvidia-smi"):
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.split()
    driver = out[0] if out else "?"
nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else "none"
nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
print(f"{torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible), "
      f"driver {driver}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
      f"python {platform.python_version()}")
EOF
)
rc=$?
echo "[gpu-check] environment: $env_line"
record "environment" "$( ((rc == 0)) && echo PASS || echo "FAIL (exit $rc)")" $(( SECONDS - start ))

# the project's dependencies (pyproject.toml), peft (LoRA) and pytest: a missing one is named here, once
step "python packages" 60 "$PY" -c "import importlib.util as u, sys
missing = [m for m in ('yaml', 'safetensors', 'huggingface_hub', 'tqdm', 'matplotlib', 'pyarrow', 'scoringrules',
                       'peft', 'pytest') if u.find_spec(m) is None]
sys.exit('missing: ' + ', '.join(missing) if missing else 0)"

summarize() {  # the table, then summary.json: steps, benchmark figures, hardware, failed tests with tracebacks
  echo
  echo "GPU check: $env_line"
  printf '%-44s %-40s %8s\n' step status seconds
  failed=0
  for i in "${!names[@]}"; do
    printf '%-44s %-40s %8s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}"
    [[ ${statuses[$i]} == FAIL* ]] && failed=1
  done
  printf '%-44s %-40s %8s\n' total "" "$SECONDS"
  for i in "${!names[@]}"; do
    printf '%s\t%s\t%s\t%s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}" "${logs[$i]}"
  done >"$WORK/steps.tsv"
  ENV_LINE="$env_line" TOTAL_S=$SECONDS BUDGET=$BUDGET_S "$PY" - "$WORK" <<'EOF' || failed=1
import json, os, sys
import xml.etree.ElementTree as ET
from pathlib import Path
work = Path(sys.argv[1])
steps = [dict(zip(("step", "status", "seconds", "log"), line.split("\t")))
         for line in (work / "steps.tsv").read_text().splitlines() if line]
for s in steps:
    s["seconds"] = int(s["seconds"])
failures = []
for xml in sorted((work / "results").glob("*.xml")):
    for case in ET.parse(xml).getroot().iter("testcase"):
        for bad in [*case.iter("failure"), *case.iter("error")]:
            failures.append({"suite": xml.stem, "test": f"{case.get('classname')}::{case.get('name')}",
                             "message": (bad.get("message") or "")[:500], "traceback": (bad.text or "")[-4000:]})
bench = {p.stem: json.loads(p.read_text()) for p in sorted((work / "results").glob("bench_*.json"))}
summary = {"hardware": os.environ["ENV_LINE"], "total_seconds": int(os.environ["TOTAL_S"]),
           "budget_seconds": int(os.environ["BUDGET"]), "steps": steps, "benchmarks": bench,
           "failed_tests": failures}
(work / "summary.json").write_text(json.dumps(summary, indent=2))
for f in failures:
    print(f"\nFAILED {f['test']} ({f['suite']}): {f['message']}\n{f['traceback'][-1500:]}")
print(f"\nsummary: {work / 'summary.json'}")
EOF
  echo "logs and outputs: $WORK"
  exit $failed
}

if [ "${1:-}" = "--suite" ]; then  # the suite beside the GPU: every test not marked cuda must ignore it
  BUDGET_S=570
  step "suite -m 'not cuda' (-n 8)" 570 "$PY" -m pytest -q -p no:cacheprovider -m "not cuda" -n 8 --dist loadgroup \
    --junitxml="$WORK/results/suite.xml" -rf
  summarize
fi

# 2. the cuda tests; a skipped one (no peft, a GPU pytest cannot see) is a failure here
if step "cuda tests (pytest -m cuda, -n 4)" 200 "$PY" -m pytest -v -p no:cacheprovider -m cuda -n 4 --dist load \
  --junitxml="$WORK/results/cuda_tests.xml" -rfs --durations=0 tests/test_cuda.py tests/test_model_decode.py \
  && grep -Eq "[0-9]+ skipped" "$log"; then
  statuses[-1]="FAIL (skipped: $(grep -Eo "[0-9]+ skipped" "$log"))"
fi

# 3. the speed targets (train step with the engine's defaults; the four forecast workloads; the host side)
step "bench_train_step.py --targets" 110 "$PY" -m finetune.benchmarks.train_step --targets \
  --json "$WORK/results/bench_train_step.json" && tail -n 3 "$log"
step "bench_generation.py --full" 80 "$PY" -m finetune.benchmarks.generation --full --repeats 3 \
  --json "$WORK/results/bench_generation.json" && tail -n 8 "$log"
step "bench_generation.py --host" 30 "$PY" -m finetune.benchmarks.generation --host \
  --json "$WORK/results/bench_host.json" && tail -n 1 "$log"

# 4. the CSV demo on the GPU (the engine trains on cuda:0 when CUDA is available)
csv=(--config configs/csv_demo.yaml --set "data.path=$WORK/csv_demo_5min" --set "paths.base_dir=$WORK/csv_demo")
step "csv demo data" 30 "$PY" scripts/make_synthetic_data.py --out "$WORK/csv_demo_5min" --n-series 4 --n-bars 3000 \
  --freq 5min --seed 0 \
  && step "csv demo: kronos finetune" 90 "$PY" -m finetune.cli finetune "${csv[@]}" \
  && step "csv demo: kronos forecast" 60 "$PY" -m finetune.cli forecast "${csv[@]}"

# 5. the Qlib demo trainers under torchrun + NCCL
qlib=()
if [ -n "${QLIB_PROCESSED:-}" ]; then
  # the splits' manifest records the Qlib folder they came from; the trainers only compare it
  raw=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1] + '/manifest.json'))['settings']['qlib_data_path'])" \
    "$QLIB_PROCESSED") && qlib=(--set "data.dataset_path=$QLIB_PROCESSED" --set "data.qlib_data_path=$raw")
  [ ${#qlib[@]} -eq 0 ] && log="" && record "qlib splits (QLIB_PROCESSED=$QLIB_PROCESSED)" "FAIL (no manifest.json)" 0
elif "$PY" -c "import qlib" 2>/dev/null; then
  step "qlib splits (synthetic, built here)" 60 bash -c "'$PY' scripts/build_qlib_data.py --synthetic 20 \
    --out '$WORK/qlib_raw' && '$PY' finetune/qlib_data_preprocess.py --config configs/qlib_demo.yaml \
    --set data.qlib_data_path='$WORK/qlib_raw' --set data.dataset_path='$WORK/qlib_processed'" \
    && qlib=(--set "data.dataset_path=$WORK/qlib_processed" --set "data.qlib_data_path=$WORK/qlib_raw")
else
  log="" && record "qlib demo trainers" "SKIP (no pyqlib, no QLIB_PROCESSED)" 0
fi
if [ ${#qlib[@]} -gt 0 ]; then
  for stage in tokenizer predictor; do
    DIST_BACKEND=nccl step "qlib $stage (torchrun, 1 rank, nccl)" 60 "$PY" -m torch.distributed.run --standalone \
      --nproc_per_node=1 "finetune/train_$stage.py" --config configs/qlib_demo.yaml "${qlib[@]}" \
      --set "paths.save_path=$WORK/qlib_demo" || break
  done
fi
summarize
