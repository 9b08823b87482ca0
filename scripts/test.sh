#!/usr/bin/env bash
# The test suite, in the project's own virtual environment (created on first use).
#   bash scripts/test.sh                 # everything (what CI runs)
#   bash scripts/test.sh --fast          # skip the tests marked slow (multi-process, end-to-end, packaging)
#   bash scripts/test.sh tests/test_x.py -x   # extra arguments go to pytest
# Two pytest-xdist workers (TEST_WORKERS=0 runs in one process); the tests that signal a running job at chosen
# moments run one after another on one of them (tests/conftest.py). The tests marked `cuda` (tests/test_cuda.py) run
# when torch sees a GPU and are skipped otherwise; `bash scripts/test.sh -m cuda` runs only them.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=()
if [ "${1:-}" = "--fast" ]; then
  shift
  fast=(-m "not slow")
fi
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup ${fast[@]+"${fast[@]}"} "$@"
