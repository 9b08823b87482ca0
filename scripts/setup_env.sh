#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install everything into it.
#
# What gets installed is declared in pyproject.toml (requirements*.txt list the same for `pip install -r` users).
#
# torch is installed *first* and pinned (TORCH_SPEC, default torch==2.13.0): pyproject.toml only says
# torch>=2.6, which an installed torch satisfies, so pip never replaces it with the newest multi-GB CUDA build.
# On a CUDA machine pick the build you want, e.g.
#   TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" bash scripts/setup_env.sh
# Re-running is cheap: a stamp keyed on the requirement files skips pip when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.installed-$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] installing $TORCH_SPEC"
    # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options (an --index-url)
    "$PY" -m pip install -q $TORCH_SPEC
  fi
  # This repository in editable mode with the `dev` extra (pyproject.toml: runtime dependencies, pytest, ruff, pyqlib,
  # tensorboard): `import model` / `import finetune` work from any directory, also for scripts launched as
  # `python finetune_csv/train_sequential.py` or `torchrun finetune/train_tokenizer.py`, and `kronos` is on PATH.
  # setuptools is made present first so the build needs no isolated environment (works offline once installed).
  echo "[setup] installing this repository with its dev extra (pip install -e '.[dev]')"
  "$PY" -m pip install -q 'setuptools>=61'
  "$PY" -m pip install -q --no-build-isolation -e '.[dev]'
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
