"""finetune/utils/errors.py: which failures are user errors (one `error:` line, a distinct exit code) and which are
bugs (traceback, exit 1); `--debug` / KRONOS_DEBUG; how `run_main` calls and reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from finetune.utils.config_utils import load_config
from finetune.utils.errors import classify, run_main
from finetune_csv.config import CsvFinetuneConfig
from model.errors import (
    EXIT_BUG,
    EXIT_CONFIG,
    EXIT_DATA,
    EXIT_INTERRUPTED,
    EXIT_MISSING_EXTRA,
    EXIT_PATH,
    EXIT_REFUSED,
    ConfigError,
    DataError,
    MissingExtraError,
    PathError,
    RefusedError,
    UserError,
)

ROOT = Path(__file__).resolve().parents[1]


def _raised(fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("expected an exception")


def test_exit_codes_are_distinct():
    codes = [EXIT_BUG, EXIT_CONFIG, EXIT_DATA, EXIT_PATH, EXIT_REFUSED, EXIT_MISSING_EXTRA, EXIT_INTERRUPTED]
    assert len(set(codes)) == len(codes) and 0 not in codes


def test_config_error_from_loader_is_a_config_error():
    exc = _raised(load_config, CsvFinetuneConfig, None, ["training.epochs=ten"])
    assert isinstance(exc, ConfigError)
    assert classify(exc) == (EXIT_CONFIG, True)


def test_plain_value_error_is_a_bug_wherever_it_was_raised():
    """Only the exception's class decides: a user-facing check raises a UserError subclass, never a plain one."""
    from finetune.utils.config_utils import read_yaml

    def ours():
        raise ValueError("an internal invariant")

    assert classify(_raised(ours)) == (EXIT_BUG, False)
    assert classify(_raised(read_yaml, "no/such/file.yaml")) == (EXIT_PATH, True)  # a typed check of ours


def test_checks_of_the_qlib_side_and_the_generators_are_user_errors(tmp_path, capsys):
    """Checks that relied on the old 'raised in our files' rule now raise typed errors: one line, exit 3."""
    from finetune.evaluation.signals import label_expression
    from finetune.qlib_builder import load_csv_folder
    from finetune.synthetic import generate_ohlcv

    for call, words in ((lambda: label_expression("bid"), "backtest.deal_price"),
                        (lambda: generate_ohlcv(2, 0), "--n-bars"),
                        (lambda: load_csv_folder(tmp_path), "no *.csv files")):
        assert run_main(lambda argv, call=call: call(), []) == EXIT_DATA
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and "Traceback" not in err


def test_value_error_from_a_library_is_a_bug():
    exc = _raised(np.reshape, np.arange(3), (2, 2))  # raised inside numpy: a check of ours is missing
    assert isinstance(exc, ValueError)
    assert classify(exc) == (EXIT_BUG, False)


@pytest.mark.parametrize(
    "exc, code",
    [
        (FileNotFoundError(2, "No such file or directory", "x.csv"), EXIT_PATH),
        (NotADirectoryError("x"), EXIT_PATH),
        (PermissionError("x"), EXIT_PATH),
        (FileExistsError("outputs/x exists"), EXIT_REFUSED),
        (KeyboardInterrupt(), EXIT_INTERRUPTED),
        (ModuleNotFoundError("No module named 'qlib'", name="qlib"), EXIT_MISSING_EXTRA),
        (ModuleNotFoundError("No module named 'qlib.data'", name="qlib.data"), EXIT_MISSING_EXTRA),
        (DataError("bad csv"), EXIT_DATA),
        (PathError("no folder"), EXIT_PATH),
        (RefusedError("would overwrite"), EXIT_REFUSED),
        (MissingExtraError("x"), EXIT_MISSING_EXTRA),
        (UserError("generic"), EXIT_DATA),
        (ConfigError(["training.lr: must be > 0"]), EXIT_CONFIG),
    ],
)
def test_user_error_classes(exc, code):
    assert classify(exc) == (code, True)


@pytest.mark.parametrize("exc", [ModuleNotFoundError("No module named 'numpy'", name="numpy"), TypeError("x"),
                                 KeyError("x"), AssertionError("x"), AttributeError("x")])
def test_everything_else_is_a_bug(exc):
    assert classify(exc) == (EXIT_BUG, False)


def test_user_error_subclasses_keep_builtin_types():
    # Code that catches ValueError / FileNotFoundError / ImportError keeps working with the new classes.
    assert issubclass(DataError, ValueError) and issubclass(PathError, FileNotFoundError)
    assert issubclass(MissingExtraError, ImportError)


def test_failed_model_load_naming_the_key_is_a_path_error(tmp_path):
    from model import KronosTokenizer
    from model.hub import load_pretrained

    exc = _raised(load_pretrained, KronosTokenizer, str(tmp_path / "missing"), "model.pretrained_tokenizer")
    assert "model.pretrained_tokenizer" in str(exc)
    assert classify(exc) == (EXIT_PATH, True)


def test_hub_lookup_failure_is_a_path_error():
    hub_errors = pytest.importorskip("huggingface_hub.errors")
    assert classify(hub_errors.LocalEntryNotFoundError("not cached and offline")) == (EXIT_PATH, True)


# ----------------------------------------------------------------------------------------------------------------
# run_main


def _main_raising(exc):
    def main(argv):
        raise exc

    return main


def test_run_main_prints_one_error_line_first_and_no_traceback(capsys, monkeypatch):
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    exc = _raised(load_config, CsvFinetuneConfig, None, ["training.epochs=ten", "data.lookback=x"])
    assert run_main(_main_raising(exc), []) == EXIT_CONFIG
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0].startswith("error: Invalid configuration")
    assert "  - training.epochs: expected int, got 'ten'" in lines
    assert "  - data.lookback: expected int, got 'x'" in lines
    assert "Traceback" not in err
    assert "--debug" in lines[-1]


def test_run_main_debug_flag_shows_traceback_and_is_removed_from_argv(capsys, monkeypatch):
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    seen = []

    def main(argv):
        seen.append(list(argv))
        raise DataError("3 rows, need 80")

    assert run_main(main, ["--config", "x.yaml", "--debug"]) == EXIT_DATA
    assert seen == [["--config", "x.yaml"]]
    err = capsys.readouterr().err
    assert err.startswith("error: 3 rows, need 80") and "Traceback" in err
    assert run_main(lambda argv: seen.append(argv), ["--", "--debug"]) == 0  # after `--` it belongs to the program
    assert seen[-1] == ["--", "--debug"]


def test_run_main_debug_environment(capsys, monkeypatch):
    monkeypatch.setenv("KRONOS_DEBUG", "1")
    assert run_main(_main_raising(FileNotFoundError(2, "No such file or directory", "data/x.csv")), []) == EXIT_PATH
    err = capsys.readouterr().err
    assert err.startswith("error: No such file or directory: data/x.csv") and "Traceback" in err


def test_run_main_bug_keeps_traceback(capsys, monkeypatch):
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    assert run_main(_main_raising(TypeError("unsupported operand")), []) == EXIT_BUG
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "TypeError: unsupported operand" in err
    assert err.splitlines()[-1].startswith("error: unexpected TypeError (a bug")


def test_run_main_keyboard_interrupt(capsys):
    assert run_main(_main_raising(KeyboardInterrupt()), []) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err.startswith("error: interrupted") and "Traceback" not in err


def test_run_main_missing_extra_names_the_extra(capsys, monkeypatch):
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    assert run_main(_main_raising(ModuleNotFoundError("No module named 'qlib'", name="qlib")), []) == 6
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("error: ") and "pip install 'kronos-finetune[qlib]'" in first


def test_run_main_return_values_and_system_exit(capsys):
    assert run_main(lambda argv: None, []) == 0
    assert run_main(lambda argv: 7, []) == 7
    assert run_main(lambda argv: {"ic": 0.1}, []) == 0  # qlib_test.main returns its summary
    assert run_main(_main_raising(SystemExit(2)), []) == 2  # argparse usage errors keep their code
    assert run_main(_main_raising(SystemExit(None)), []) == 0
    assert run_main(_main_raising(SystemExit("error: give --n-bars or --end")), []) == EXIT_DATA
    assert capsys.readouterr().err == "error: give --n-bars or --end\n"


@pytest.mark.slow
def test_script_error_in_a_subprocess_has_no_traceback(tmp_path):
    """The real thing: `python finetune_csv/train_sequential.py` with a bad setting."""
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "finetune_csv/train_sequential.py"), "--config",
           str(ROOT / "configs/csv_demo.yaml"), "--set", "training.epochs=0", "--set", "data.lookback=-1"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == EXIT_CONFIG, res.stderr
    assert res.stderr.startswith("error: Invalid CSV finetuning configuration (2 problems)")
    assert "training.epochs" in res.stderr and "data.lookback" in res.stderr
    assert "Traceback" not in res.stderr
    res = subprocess.run(cmd + ["--debug"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == EXIT_CONFIG and "Traceback" in res.stderr


def test_exit_code_table_in_docstring_matches_constants():
    import model.errors as codes

    for name in ("EXIT_BUG", "EXIT_CONFIG", "EXIT_DATA", "EXIT_PATH", "EXIT_REFUSED", "EXIT_MISSING_EXTRA",
                 "EXIT_INTERRUPTED"):
        assert f"\n    {getattr(codes, name)} " in codes.__doc__, name
