"""The `kronos` command (finetune/cli.py): every subcommand runs the script's own `main`, help is fast and needs no
extras, missing extras and launches are reported with the fix, and the scripts behave the same."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import cli
from model.errors import EXIT_CONFIG, EXIT_DATA, EXIT_MISSING_EXTRA

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}

SCRIPT_OF = {  # the file each subcommand stands for (README commands)
    "finetune": "finetune_csv/train_sequential.py",
    "forecast": "finetune_csv/forecast.py",
    "walk-forward": "finetune_csv/walk_forward.py",
    "tune": "finetune_csv/walk_forward.py",
    "track": "finetune_csv/journal.py",
    "serve": "finetune_csv/serve.py",
    "qlib-preprocess": "finetune/qlib_data_preprocess.py",
    "qlib-train-tokenizer": "finetune/train_tokenizer.py",
    "qlib-train-predictor": "finetune/train_predictor.py",
    "qlib-backtest": "finetune/qlib_test.py",
    "qlib-walk-forward": "finetune/qlib_walk_forward.py",
    "report": "finetune/evaluation/report.py",
    "qlib-tune": "finetune/qlib_walk_forward.py",
    "build-qlib-store": "finetune/qlib_builder.py",
    "make-synthetic": "finetune/synthetic.py",
    "benchmark": "finetune/benchmarks/__init__.py",
}


def test_every_entry_point_has_a_subcommand():
    assert set(cli.COMMANDS) == set(SCRIPT_OF)


@pytest.mark.parametrize("name", sorted(SCRIPT_OF))
def test_subcommand_runs_the_scripts_main(name):
    assert SCRIPT_OF[name].split("/")[0] in ("finetune", "finetune_csv")  # in the wheel: no clone needed
    main = cli.resolve(name)
    assert main.__name__ == cli.COMMANDS[name].entry
    assert Path(main.__code__.co_filename).resolve() == (ROOT / SCRIPT_OF[name]).resolve()
    target = cli.COMMANDS[name].target
    assert main is getattr(importlib.import_module(target), cli.COMMANDS[name].entry)  # the same function


def test_help_lists_every_command_without_importing_torch_or_qlib(tmp_path):
    code = ("import sys; from finetune.cli import main; rc = main(['--help']); "
            "print('LOADED', 'torch' in sys.modules, 'qlib' in sys.modules, 'pandas' in sys.modules, rc)")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    for name in cli.COMMANDS:
        assert f"  {name} " in res.stdout
    assert "LOADED False False False 0" in res.stdout


def test_unknown_command_suggests_the_close_one(capsys):
    assert cli.main(["forcast"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown command 'forcast' (did you mean 'forecast'?)")


def test_no_command_prints_usage(capsys):
    assert cli.main([]) == 0
    assert capsys.readouterr().out.startswith("usage: kronos")


def test_subcommand_help_is_named_after_the_subcommand(capsys):
    argv0 = sys.argv[0]
    assert cli.main(["finetune", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kronos finetune") and "--skip-tokenizer" in out
    assert sys.argv[0] == argv0  # restored


def test_missing_qlib_names_the_extra_before_any_work(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "qlib" else real(n, *a))
    for name in ("qlib-preprocess", "qlib-backtest"):
        assert cli.main([name, "--config", str(ROOT / "configs/qlib_demo.yaml")]) == EXIT_MISSING_EXTRA
        err = capsys.readouterr().err
        assert err.startswith(f"error: kronos {name} needs the optional dependency 'qlib'")
        assert "pip install 'kronos-finetune[qlib]'" in err.splitlines()[0]


def test_trainer_outside_torchrun_shows_the_kronos_torchrun_command(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["qlib-train-tokenizer", "--config", "my.yaml"]) == EXIT_DATA
    err = capsys.readouterr().err
    assert err.startswith("error: this trainer trains with DistributedDataParallel and must be launched by torchrun")
    assert "torchrun --standalone --nproc_per_node=1 --no-python kronos qlib-train-tokenizer --config my.yaml" in err
    assert "-m finetune.cli qlib-train-tokenizer --config my.yaml" in err


def test_config_error_through_kronos(capsys, monkeypatch):
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    rc = cli.main(["finetune", "--config", str(ROOT / "configs/csv_demo.yaml"), "--set", "data.stride=0"])
    assert rc == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: Invalid CSV finetuning configuration") and "data.stride" in err
    assert "Traceback" not in err


def test_make_synthetic_through_kronos(tmp_path):
    out = tmp_path / "candles"
    assert cli.main(["make-synthetic", "--out", str(out), "--n-series", "2", "--n-bars", "40", "--seed", "1"]) == 0
    files = sorted(p.name for p in out.glob("*.csv"))
    assert len(files) == 2
    assert len((out / files[0]).read_text().splitlines()) == 41  # header + 40 bars


@pytest.mark.slow
def test_script_path_names_the_extra_when_qlib_is_missing(tmp_path):
    # `python finetune/qlib_data_preprocess.py` in an environment without pyqlib (hidden via sys.modules).
    code = ("import sys, runpy; sys.modules['qlib'] = None; "
            f"sys.argv = ['qlib_data_preprocess.py', '--config', {str(ROOT / 'configs/qlib_demo.yaml')!r}]; "
            f"runpy.run_path({str(ROOT / 'finetune/qlib_data_preprocess.py')!r}, run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == EXIT_MISSING_EXTRA, res.stderr
    assert res.stderr.startswith("error: qlib_data_preprocess.py needs the optional dependency 'qlib'")
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_torchrun_module_form_runs_the_trainer(tmp_path):
    """`torchrun -m finetune.cli qlib-train-tokenizer ...` reaches the trainer's own input checks."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this python")
    env = dict(ENV, DIST_BACKEND="gloo")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node=1", "-m", "finetune.cli", "qlib-train-tokenizer",
           "--config", str(ROOT / "configs/qlib_demo.yaml"), "--set", f"data.dataset_path={tmp_path / 'none'}"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "data.dataset_path" in res.stderr, res.stderr[-3000:]
    assert "must be launched by torchrun" not in res.stderr  # it was: the launch check passed
