"""The `kronos` command: one entry for every pipeline step, each running the same `main(argv)` as its script.

    kronos finetune --config configs/csv_demo.yaml                # = python finetune_csv/train_sequential.py ...
    kronos forecast --config configs/csv_demo.yaml                # = python finetune_csv/forecast.py ...
    kronos qlib-preprocess --config configs/qlib_demo.yaml        # = python finetune/qlib_data_preprocess.py ...
    torchrun --standalone --nproc_per_node=2 --no-python kronos qlib-train-tokenizer --config ...
    torchrun --standalone --nproc_per_node=2 -m finetune.cli qlib-train-predictor --config ...
    kronos <command> --help | --help-config | --print-config      # the step's flags / every config key / resolved YAML

Subcommand modules are imported only when their command runs, so `kronos --help` is fast and works without the
optional extras (pyqlib). `--debug` (anywhere) or KRONOS_DEBUG=1 shows tracebacks of user errors; exit codes are
documented in finetune/utils/errors.py.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.utils.errors import MissingExtraError, PathError, UserError, run_main

__all__ = ["Command", "COMMANDS", "main", "resolve", "run_script"]

_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Command:
    """One `kronos` subcommand and where its `main(argv)` lives."""

    target: str
    """`package.module` (imported) or `scripts/<file>.py` (loaded from the source checkout) holding `main`."""
    summary: str
    """One line for `kronos --help`."""
    config: str | None = None
    """'csv' or 'qlib': which settings `--help-config` / `--print-config` describe (None: the command has no YAML)."""
    needs: tuple[str, ...] = ()
    """Optional modules the command imports (checked first, so a missing extra is named before any work)."""
    torchrun: bool = False
    """The command must be started by torchrun."""


COMMANDS: dict[str, Command] = {
    "finetune": Command("finetune_csv.train_sequential",
                        "CSV pipeline: finetune the tokenizer, then the predictor (also under torchrun)", "csv"),
    "forecast": Command("finetune_csv.forecast", "CSV pipeline: forecast the held-out test split and score it", "csv"),
    "qlib-preprocess": Command("finetune.qlib_data_preprocess",
                               "Qlib pipeline: read a Qlib store and write the train/val/test splits", "qlib",
                               needs=("qlib",)),
    "qlib-train-tokenizer": Command("finetune.train_tokenizer", "Qlib pipeline: finetune the tokenizer (torchrun)",
                                    "qlib", torchrun=True),
    "qlib-train-predictor": Command("finetune.train_predictor", "Qlib pipeline: finetune the predictor (torchrun)",
                                    "qlib", torchrun=True),
    "qlib-backtest": Command("finetune.qlib_test", "Qlib pipeline: forecast the test split, IC/RankIC and backtest",
                             "qlib", needs=("qlib",)),
    "build-qlib-store": Command("scripts/build_qlib_data.py",
                               "write a Qlib data folder from daily CSVs (or synthetic data) for the Qlib pipeline"),
    "make-synthetic": Command("scripts/make_synthetic_data.py", "write synthetic OHLCV candles, one CSV per symbol"),
    "benchmark": Command("scripts/benchmark.py", "run the benchmarks (scripts/bench_*.py) and print their tables"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: kronos [--debug] <command> [options]",
        "",
        "Finetune Kronos candlestick models on your data (CSV or Qlib), forecast and backtest.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()),
        "",
        "options of every command with settings: --config FILE, --set KEY=VALUE (repeatable),",
        "  --help (its flags), --help-config (every settings key: type, default, meaning),",
        "  --print-config (the resolved settings after --set, as YAML)",
        "--debug or KRONOS_DEBUG=1: show the traceback of user errors too.",
        "exit codes: 0 ok, 1 bug, 2 configuration, 3 data/run check, 4 path or Hub, 5 refused to overwrite,",
        "  6 optional dependency missing, 75 stopped on SIGTERM/Ctrl-C after saving (the same command resumes),",
        "  130 interrupted (a second Ctrl-C).",
        "",
        "Under torchrun:  torchrun --standalone --nproc_per_node=N --no-python kronos <command> ...",
        "             or  torchrun --standalone --nproc_per_node=N -m finetune.cli <command> ...",
    ]
    return "\n".join(lines)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kronos-finetune")
    except Exception:  # noqa: BLE001 - not installed (run from a checkout with PYTHONPATH)
        return "unknown (not installed)"


def resolve(name: str) -> Callable[..., Any]:
    """The `main` function behind subcommand `name` (imports its module; loads scripts/ files by path)."""
    cmd = COMMANDS[name]
    if not cmd.target.startswith("scripts/"):
        return importlib.import_module(cmd.target).main
    path = _ROOT / cmd.target
    if not path.is_file():
        raise PathError(f"'kronos {name}' runs {cmd.target} from the source checkout, which is not next to the "
                        f"installed package ({path} does not exist); clone the repository and `pip install -e .`")
    module_name = f"kronos_scripts_{path.stem}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name].main


def _check_ready(name: str, cmd: Command, args: Sequence[str]) -> None:
    """Fail early, with the fix, when an optional dependency or the torchrun launch is missing."""
    for module in cmd.needs:
        if importlib.util.find_spec(module) is None:
            raise MissingExtraError.for_module(module, f"kronos {name}")
    wants_help = any(a in ("-h", "--help", "--help-config", "--print-config") for a in args)
    if cmd.torchrun and not wants_help and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        shown = " ".join(args) or "--config <your.yaml>"
        raise UserError(
            f"kronos {name} trains with DistributedDataParallel and must be launched by torchrun, e.g.\n"
            f"  torchrun --standalone --nproc_per_node=1 --no-python kronos {name} {shown}\n"
            f"  torchrun --standalone --nproc_per_node=1 -m finetune.cli {name} {shown}\n"
            "Use --nproc_per_node=<number of GPUs>; on a machine without GPUs put DIST_BACKEND=gloo in front."
        )


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(f"kronos {_version()}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"error: unknown command '{name}'{hint}; `kronos --help` lists the commands", file=sys.stderr)
        return 2
    return _run_command(name, args, entry=None)


def _run_command(name: str, args: list[str], entry: Callable[..., Any] | None) -> int:
    """What `kronos <name>` and the script behind it share: config flags, readiness checks, original configs.

    `entry` None = the `kronos` path (import the command's main, check the torchrun launch here so the hint names
    `kronos`); a function = the script path (`python finetune_csv/forecast.py ...`), whose main reports itself.
    """
    cmd = COMMANDS[name]
    prog = f"kronos {name}" if entry is None else None
    if cmd.config is not None and ("--help-config" in args or "--print-config" in args):
        from finetune.utils.config_help import run_config_flags

        return run_config_flags(prog or os.path.basename(sys.argv[0]), cmd.config, args)
    if entry is None:
        _check_ready(name, cmd, args)
        entry = resolve(name)
    else:
        for module in cmd.needs:  # the script path imports qlib lazily; name the extra before any work
            if importlib.util.find_spec(module) is None:
                raise MissingExtraError.for_module(module, os.path.basename(sys.argv[0]))
    with contextlib.ExitStack() as stack:
        if cmd.config == "csv":  # a YAML in the original Kronos finetune_csv format runs too
            from finetune_csv.legacy_config import translated_argv

            args = stack.enter_context(translated_argv(args))
        saved = sys.argv[0]
        if prog is not None:  # argparse names the program after sys.argv[0]: `usage: kronos finetune ...`
            sys.argv[0] = prog
        try:
            result = entry(list(args))
        finally:
            sys.argv[0] = saved
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def run_script(name: str, main: Callable[..., Any], argv: Sequence[str] | None = None) -> int:
    """The `__main__` block of the script behind `kronos <name>`: `sys.exit(run_script("forecast", main))`.

    Same behaviour as the subcommand (clean errors and exit codes, --debug, --help-config, --print-config,
    original-format CSV configs); returns the exit code.
    """
    return run_main(lambda args: _run_command(name, args, entry=main), argv)


def main(argv: Sequence[str] | None = None) -> int:
    """`kronos` console script: run one subcommand; returns the process exit code (see finetune/utils/errors.py)."""
    return run_main(_dispatch, argv)


if __name__ == "__main__":
    sys.exit(main())
