#!/usr/bin/env bash
# The test suite, in the project's own virtual environment (created on first use).
#   bash scripts/test.sh                 # everything (what CI runs)
#   bash scripts/test.sh --fast          # skip the tests marked slow (multi-process, end-to-end, packaging)
#   bash scripts/test.sh tests/test_x.py -x   # extra arguments go to pytest
# Two pytest-xdist workers (TEST_WORKERS=0 runs in one process); the tests that signal a running job at chosen
# moments run one after another on one of them (tests/conftest.py). The tests marked `cuda` (tests/test_cuda.py) run
# when torch sees a GPU and are skipped otherwise; `bash scripts/test.sh -m cuda` runs only them. The browser test of
# report.html needs chromium and playwright, installed below when possible.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=()
if [ "${1:-}" = "--fast" ]; then
  shift
  fast=(-m "not slow")
fi
bash scripts/setup_env.sh
# The browser test of report.html (tests/test_report_browser.py) drives Debian's chromium with Playwright's Python
# package and skips itself, saying why, when either is missing. Both are installed here when that can work: pip
# into .venv, apt-get as root on Debian (not for --fast: the test is slow). Never `playwright install`: it downloads its own browser build.
if [ ${#fast[@]} -eq 0 ] && ! .venv/bin/python -c "import playwright" 2>/dev/null; then
  .venv/bin/python -m pip install -q playwright \
    || echo "[test] could not pip install playwright: the report.html browser test will be skipped"
fi
if [ ${#fast[@]} -eq 0 ] && [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null \
      || echo "[test] apt-get install chromium failed: the report.html browser test will be skipped"
  else
    echo "[test] no /usr/bin/chromium and not root on Debian (apt-get install chromium): the report.html browser" \
         "test will be skipped"
  fi
fi
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup ${fast[@]+"${fast[@]}"} "$@"
