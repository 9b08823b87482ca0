"""The README's marked commands and snippets run as written (see tests/readme_blocks.py for the marks).

- `install`: its `kronos` lines run here (and in the fresh-venv install test, tests/test_packaging.py, after the
  block's `pip install .`);
- `python` ("Finetune from Python") is executed in a scratch folder that sees the repository's configs and the demo
  checkpoint;
- `original` ("Coming from the original Kronos") runs an original-format config end to end on the demo's data.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.readme_blocks import ROOT, readme_block, shell_commands


def scratch(tmp_path: Path) -> Path:
    """A working folder like the repository root: configs/ and checkpoints/ linked, outputs written here."""
    for name in ("configs", "checkpoints"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def kronos(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "finetune.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow  # every `kronos` line of the install block in a subprocess
def test_install_block_installs_the_package_and_its_kronos_lines_work(tmp_path):
    commands = shell_commands(readme_block("install"))
    assert ["pip", "install", "."] in commands  # what tests/test_packaging.py does in a fresh venv
    lines = [c[1:] for c in commands if c[0] == "kronos"]
    assert lines
    for args in lines:
        res = kronos(args, scratch(tmp_path) if not (tmp_path / "configs").exists() else tmp_path)
        assert res.returncode == 0, (args, res.stderr[-2000:])
        assert res.stdout.strip()


@pytest.mark.slow
def test_finetune_from_python_snippet_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(scratch(tmp_path))
    path = tmp_path / "snippet.py"
    path.write_text(readme_block("python"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess tests (OMP_NUM_THREADS=1): two threads on a busy 2-core CI box thrash
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "basemodel/best_model" in out  # the result names the finetuned predictor
    assert (tmp_path / "outputs/from_python/basemodel/best_model/kronos_predictor.json").is_file()


@pytest.mark.slow
def test_original_format_config_runs_unchanged(tmp_path):
    work = scratch(tmp_path)
    # The demo's first CSV (the one the config reads), 800 bars instead of 3000: with windows of 256 + 32 candles
    # and ratios 0.8/0.15/0.05 that is 353 training windows (3 optimizer steps of 2 accumulated batches of 64 per
    # stage), 89 validation and 9 test windows.
    gen = subprocess.run([sys.executable, str(ROOT / "scripts/make_synthetic_data.py"), "--out",
                          "data/generated/csv_demo_5min", "--n-series", "1", "--n-bars", "800", "--seed", "0"],
                         cwd=work, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    commands = shell_commands(readme_block("original"))
    assert all(c[:2] == ["kronos", "finetune"] for c in commands) and len(commands) == 2
    printed = kronos(commands[0][1:], work)
    assert printed.returncode == 0 and "lookback: 256" in printed.stdout, printed.stderr[-2000:]
    trained = kronos(commands[1][1:], work)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "data.lookback_window -> data.lookback" in trained.stderr + trained.stdout  # one line per mapped key
    out = work / "outputs/original_format_example"
    for stage in ("tokenizer", "basemodel"):
        assert (out / stage / "best_model/model.safetensors").is_file()
        info = json.loads((out / stage / "run_info.json").read_text())
        assert info["result"]["global_step"] == 3 and info["result"]["finished"] is True  # 1 epoch as overridden
