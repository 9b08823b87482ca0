"""The `kronos` command: one entry for every pipeline step, each running the same `main(argv)` as its script.

    kronos finetune --config configs/csv_demo.yaml          (= python finetune_csv/train_sequential.py ...)
    kronos qlib-train-tokenizer ...                         (checks the torchrun launch first, naming `kronos`)

`COMMANDS` is the registry of both pipelines' steps (the engine under finetune/utils/ knows neither). Each
command's own parser has --config / --set / --help-config / --print-config (`cli_args.add_config_args`);
errors and exit codes are `errors.run_main`'s."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.utils.errors import run_main


@dataclass(frozen=True)
class Command:
    """One `kronos` subcommand and where its `main(argv)` lives."""

    target: str  # `package.module` holding `main`: every command is in the installed package.
    summary: str  # One line for `kronos --help`.
    torchrun: bool = False  # The command must be started by torchrun.
    entry: str = "main"  # The function of `target` the command runs.


COMMANDS: dict[str, Command] = {
    "finetune": Command("finetune_csv.train_sequential",
                        "CSV pipeline: finetune the tokenizer, then the predictor (also under torchrun)"),
    "forecast": Command("finetune_csv.forecast", "CSV pipeline: forecast the held-out test split and score it"),
    "track": Command("finetune_csv.journal", "CSV pipeline: score the journaled --future forecasts whose outcomes "
                     "arrived"),
    "walk-forward": Command("finetune_csv.walk_forward",
                            "CSV pipeline: does finetuning pay? purged walk-forward folds, paired test, verdict"),
    "tune": Command("finetune_csv.walk_forward", "CSV pipeline: which finetuning settings pay? a study judged on the "
                    "walk-forward's blocks", entry="tune_main"),
    "qlib-preprocess": Command("finetune.qlib_data_preprocess",
                               "Qlib pipeline: read a Qlib store and write the train/val/test splits"),
    "qlib-train-tokenizer": Command("finetune.train_tokenizer", "Qlib pipeline: finetune the tokenizer (torchrun)",
                                    torchrun=True),
    "qlib-train-predictor": Command("finetune.train_predictor", "Qlib pipeline: finetune the predictor (torchrun)",
                                    torchrun=True),
    "qlib-backtest": Command("finetune.qlib_test", "Qlib pipeline: forecast the test split, IC/RankIC and backtest"),
    "qlib-walk-forward": Command("finetune.qlib_walk_forward",
                                 "Qlib pipeline: rolling retrains over test periods, finetuned vs zero-shot verdict"),
    "report": Command("finetune.evaluation.report",
                      "rebuild RUN_DIR/report.html (forecasts, scores, training, folds) from a finished run's files"),
    "qlib-tune": Command("finetune.qlib_walk_forward", "Qlib pipeline: which finetuning settings pay? a study judged "
                         "on the walk-forward's periods", entry="tune_main"),
    "build-qlib-store": Command("finetune.qlib_builder",
                               "write a Qlib data folder from daily CSVs (or synthetic data) for the Qlib pipeline"),
    "make-synthetic": Command("finetune.synthetic", "write synthetic OHLCV candles, one CSV per symbol"),
    "serve": Command("finetune_csv.serve", "serve models over HTTP: forecasts micro-batched, metrics, a page"),
    "benchmark": Command("finetune.benchmarks", "run the benchmarks (finetune/benchmarks/) and print their tables"),
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
        return importlib.metadata.version("kronos-finetune")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout with PYTHONPATH
        return "unknown (not installed)"


def resolve(name: str) -> Callable[..., Any]:
    """The `main` function behind subcommand `name` (imports its module)."""
    cmd = COMMANDS[name]
    return getattr(importlib.import_module(cmd.target), cmd.entry)


def _check_ready(name: str, cmd: Command, args: Sequence[str]) -> None:
    """Fail early, with the fix, when the torchrun launch is missing (not for help)."""
    if cmd.torchrun and not any(a in ("-h", "--help", "--help-config", "--print-config") for a in args):
        from finetune.utils.distributed import require_torchrun  # imports torch: only for the trainers

        require_torchrun(f"--no-python kronos {name}", f"-m finetune.cli {name}",
                         args=" ".join(args) or "--config <your.yaml>")


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(f"kronos {_version()}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"error: unknown command '{name}'{hint}; `kronos --help` lists the commands", file=sys.stderr)
        return 2
    _check_ready(name, COMMANDS[name], args)
    entry = resolve(name)
    from model.predictor import use_chosen_threads  # torch loads only for a command that runs

    use_chosen_threads()
    # argparse names the program after sys.argv[0]; the lock and logs quote sys.argv ("kronos finetune --config x")
    saved, sys.argv = sys.argv, [f"kronos {name}", *args]
    try:
        result = entry(list(args))
    finally:
        sys.argv = saved
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """`kronos` console script: run one subcommand; returns the process exit code (see finetune/utils/errors.py)."""
    return run_main(_dispatch, argv)


if __name__ == "__main__":
    sys.exit(main())
