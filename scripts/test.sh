#!/usr/bin/env bash
# The whole test suite, in the project's own virtual environment (created on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
