#!/usr/bin/env bash
# One GPU check (issue 23): what this repository promises on a GPU, run on a machine with one NVIDIA GPU and
# nothing downloaded, in at most 8 minutes (each step's time limit is cut to what is left of them):
#
#   bash scripts/gpu_check.sh
#
#   1. one environment line: GPU, driver, torch, CUDA, NCCL, python,
#   2. the `cuda` tests (tests/test_cuda.py: kill / SIGTERM / torchrun restart then resume on cuda equal to the
#      uninterrupted run, bf16 training of both CSV stages, forecast cuda vs CPU, LoRA, calibration),
#   3. the Qlib demo trainers (configs/qlib_demo.yaml) under torchrun --standalone --nproc_per_node=1 with
#      DIST_BACKEND=nccl, on the splits in $QLIB_PROCESSED (a folder finetune/qlib_data_preprocess.py wrote with that
#      config; the raw Qlib data is not needed), else built here when pyqlib is installed, else SKIP,
#      To make such a folder where pyqlib is installed (3 MB; carry it to the GPU machine):
#        python scripts/build_qlib_data.py --synthetic 20 --out data/generated/qlib_demo
#        python finetune/qlib_data_preprocess.py --config configs/qlib_demo.yaml  # -> data/generated/qlib_demo_processed
#   4. the CSV demo on the GPU: synthetic candles, `kronos finetune`, `kronos forecast` (configs/csv_demo.yaml),
#   5. the benchmarks of the targets (issue 34): bench_train_step.py --targets (Kronos-small 64 x 512, Kronos-base
#      32 x 512, engine defaults, tokens/s and MFU vs 790 TFLOP/s), bench_generation.py (four forecast workloads,
#      eager vs static vs graph, identical greedy output).
# Steps 2 and 5 run first (the figures the check exists to give), then 4 and 3 in what is left. Then one table
# (step, status, seconds) and $WORK/summary.json: each step's status and seconds, the benchmark figures, the hardware,
# and the traceback of every failed cuda test; the exit status is 1 when any step failed. Everything goes to one
# folder: $GPU_CHECK_OUT, else $OUT, else a new temporary folder. Python: .venv/bin/python when there is one, else
# python3 with this checkout on PYTHONPATH (nothing installed). Without a GPU (or with CUDA_VISIBLE_DEVICES="") it
# says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1

if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  if [ "${CUDA_VISIBLE_DEVICES-unset}" != "" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
    echo "a GPU is present (nvidia-smi) but torch cannot use it ($PY):" >&2
    "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" >&2
    exit 1
  fi
  echo "no GPU: nothing to check"
  exit 0
fi

WORK="${GPU_CHECK_OUT:-${OUT:-$(mktemp -d -t kronos-gpu-check.XXXXXX)}}"
mkdir -p "$WORK/logs"
BUDGET_S=480
names=() statuses=() seconds=()

record() {  # record NAME STATUS SECONDS
  names+=("$1") statuses+=("$2") seconds+=("$3")
  echo "[gpu-check] $1: $2 ($3 s)"
}

step() {  # step NAME MAX_SECONDS COMMAND...: run it (log: $WORK/logs/<n>.log) under what is left of the budget
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  local left=$(( BUDGET_S - SECONDS ))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then
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

# 2. the cuda tests, 4 workers (the kill tests share one: tests/conftest.py); a skipped one (no peft, a GPU pytest
# cannot see) is a failure here; failures' tracebacks go to summary.json from the JUnit XML
if step "cuda tests (pytest -m cuda)" 210 "$PY" -m pytest -q -p no:cacheprovider -m cuda -n 4 --dist loadgroup \
  --junitxml="$WORK/cuda-tests.xml" tests/test_cuda.py tests/test_model_decode.py && grep -Eq "[0-9]+ skipped" "$log"
then
  statuses[-1]="FAIL (skipped: $(grep -Eo "[0-9]+ skipped" "$log"))"
fi

# 5. the benchmarks of the targets
step "bench_train_step.py --targets" 130 "$PY" scripts/bench_train_step.py --targets --json "$WORK/bench_train.json" \
  && tail -n 3 "$log"
step "bench_generation.py" 75 "$PY" scripts/bench_generation.py --full --json "$WORK/bench_generation.json" \
  && tail -n 6 "$log"

# 4. the CSV demo on the GPU (the engine trains on cuda:0 when CUDA is available)
csv=(--config configs/csv_demo.yaml --set "data.path=$WORK/csv_demo_5min" --set "paths.base_dir=$WORK/csv_demo")
step "csv demo data" 60 "$PY" scripts/make_synthetic_data.py --out "$WORK/csv_demo_5min" --n-series 4 --n-bars 3000 \
  --freq 5min --seed 0 \
  && step "csv demo: kronos finetune" 150 "$PY" -m finetune.cli finetune "${csv[@]}" \
  && step "csv demo: kronos forecast" 120 "$PY" -m finetune.cli forecast "${csv[@]}"

# 3. the Qlib demo trainers under torchrun + NCCL
qlib=()
if [ -n "${QLIB_PROCESSED:-}" ]; then
  # the splits' manifest records the Qlib folder they came from; the trainers only compare it
  raw=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1] + '/manifest.json'))['settings']['qlib_data_path'])" \
    "$QLIB_PROCESSED") && qlib=(--set "data.dataset_path=$QLIB_PROCESSED" --set "data.qlib_data_path=$raw")
  [ ${#qlib[@]} -eq 0 ] && record "qlib splits (QLIB_PROCESSED=$QLIB_PROCESSED)" "FAIL (no manifest.json)" 0
elif "$PY" -c "import qlib" 2>/dev/null; then
  step "qlib splits (synthetic, built here)" 120 bash -c "'$PY' scripts/build_qlib_data.py --synthetic 20 \
    --out '$WORK/qlib_raw' && '$PY' finetune/qlib_data_preprocess.py --config configs/qlib_demo.yaml \
    --set data.qlib_data_path='$WORK/qlib_raw' --set data.dataset_path='$WORK/qlib_processed'" \
    && qlib=(--set "data.dataset_path=$WORK/qlib_processed" --set "data.qlib_data_path=$WORK/qlib_raw")
else
  record "qlib demo trainers" "SKIP (no pyqlib, no QLIB_PROCESSED)" 0
fi
if [ ${#qlib[@]} -gt 0 ]; then
  for stage in tokenizer predictor; do
    DIST_BACKEND=nccl step "qlib $stage (torchrun, 1 rank, nccl)" 150 "$PY" -m torch.distributed.run --standalone \
      --nproc_per_node=1 "finetune/train_$stage.py" --config configs/qlib_demo.yaml "${qlib[@]}" \
      --set "paths.save_path=$WORK/qlib_demo" || break
  done
fi

echo
echo "GPU check: $env_line"
printf '%-44s %-40s %8s\n' step status seconds
failed=0
for i in "${!names[@]}"; do
  printf '%-44s %-40s %8s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}"
  [[ ${statuses[$i]} == FAIL* ]] && failed=1
done
printf '%-44s %-40s %8s\n' total "" "$SECONDS"
# summary.json: the table, the figures, the hardware, the failed tests' tracebacks (printed too)
printf '%s\n' "${names[@]}" >"$WORK/.names"; printf '%s\n' "${statuses[@]}" >"$WORK/.statuses"
"$PY" - "$WORK" "$env_line" "${seconds[@]}" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
work, hardware, secs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
names, statuses = ((work / f).read_text().splitlines() for f in (".names", ".statuses"))
read = lambda f: json.loads((work / f).read_text()) if (work / f).exists() else None  # noqa: E731
failures = {}
if (work / "cuda-tests.xml").exists():
    for case in ET.parse(work / "cuda-tests.xml").iter("testcase"):
        for bad in [*case.iter("failure"), *case.iter("error")]:
            failures[f"{case.get('classname')}::{case.get('name')}"] = (bad.text or bad.get("message") or "")[-6000:]
summary = {"hardware": hardware, "steps": [{"step": n, "status": s, "seconds": int(t)}
                                          for n, s, t in zip(names, statuses, secs)],
           "train_step": read("bench_train.json"), "forecast": read("bench_generation.json"),
           "failed_tests": failures}
(work / "summary.json").write_text(json.dumps(summary, indent=2))
for name, text in failures.items():
    print(f"\n=== FAILED {name}\n{text}")
EOF
rm -f "$WORK/.names" "$WORK/.statuses"
echo "logs, outputs and summary.json: $WORK"
exit $failed
