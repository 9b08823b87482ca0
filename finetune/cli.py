"""Self-documenting settings: every YAML key of a config dataclass with its type, default and docstring.

The docstrings are the one-line string literals under each field (read with `ast`, so they need not be repeated
anywhere). Entry points expose them as flags:

    parser = add_help_config_args(parser, CsvFinetuneConfig, csv_config.load)
    # --help-config   prints every key (type, default, meaning) and exits, like --help
    # --print-config  prints the resolved settings (YAML file + --set overrides) as YAML and exits

`kronos <command> --help-config` / `--print-config` use `run_config_flags`.

Also here:
- The `kronos` command: one entry for every pipeline step, each running the same `main(argv)` as its script.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from finetune.utils.errors import MissingExtraError, PathError, UserError, run_main


@dataclass(frozen=True)
class KeyDoc:
    """One leaf setting."""

    key: str
    """Dotted YAML key, e.g. `training.epochs`."""
    type: str
    """Readable type, e.g. `int`, `float | null`, `'error' | 'ffill' | 'drop'`."""
    default: Any
    """Default value (what a YAML file that leaves the key out gets)."""
    doc: str
    """The field's docstring (empty when it has none)."""


@dataclass(frozen=True)
class SectionDoc:
    """A nested dataclass: one YAML mapping."""

    key: str
    """Dotted key of the section ('' for the top level)."""
    doc: str
    """The section's docstring (its field docstring, else the class docstring's first line)."""


def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} of dataclass `cls`, including inherited fields (a subclass's docstring wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(source)
    klass = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    if klass is None:
        return {}
    docs: dict[str, str] = {}
    body = klass.body
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def describe_config(cls: type, prefix: str = "") -> list[KeyDoc | SectionDoc]:
    """Every section and leaf key of dataclass `cls`: a section's own keys, then its subsections (depth first)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"describe_config expects a dataclass type, got {cls!r}")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    leaves: list[KeyDoc | SectionDoc] = []
    sections: list[KeyDoc | SectionDoc] = []  # after the leaves, so that every key sits under its own header
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            class_doc = (inspect.getdoc(tp) or "").split("\n")[0]
            sections.append(SectionDoc(key, docs.get(f.name) or class_doc))
            sections.extend(describe_config(tp, key))
        else:
            leaves.append(KeyDoc(key, type_name(tp), _default(f), docs.get(f.name, "")))
    return leaves + sections


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def type_name(tp: Any) -> str:
    """Readable name of a type annotation (`None` shown as YAML's `null`)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args if a is not Ellipsis)
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{inner}]" if inner else name
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _show_default(value: Any) -> str:
    """A default as it would be written in YAML (null, true, "text", [a, b])."""
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show_default(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show_default(v)}" for k, v in value.items()) + "}"
    return repr(value)


def format_config_help(cls: type, title: str | None = None, width: int = 118) -> str:
    """The listing `--help-config` prints: sections as headers, then `key: type = default` and its docstring."""
    lines = [title or f"Settings of {cls.__name__} (YAML keys; override any with --set KEY=VALUE):"]
    for item in describe_config(cls):
        if isinstance(item, SectionDoc):
            lines += ["", f"{item.key}:" + (f"  # {item.doc}" if item.doc else "")]
            continue
        lines.append(f"  {item.key}: {item.type} = {_show_default(item.default)}")
        if item.doc:
            lines += textwrap.wrap(item.doc, width=width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# command line


class _HelpConfigAction(argparse.Action):
    """`--help-config`: print every key and exit (like --help, before required arguments are checked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, config_cls: type, **kwargs: Any):
        self.config_cls = config_cls
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(format_config_help(self.config_cls))
        parser.exit(0)


def add_help_config_args(parser: argparse.ArgumentParser, config_cls: type,
                         load_fn: Callable[[str | None, Sequence[str]], Any]) -> argparse.ArgumentParser:
    """Add `--help-config` and `--print-config` to a parser that has `--config` and `--set` (add_config_args).

    Parameters
    ----------
    parser: the entry point's parser.
    config_cls: the settings dataclass the entry point loads.
    load_fn: `load_fn(config_path, overrides) -> config` (e.g. `finetune_csv.config.load`, `finetune.config.load`);
        `--print-config` calls it, so it prints exactly what a run would use (and fails the same way).

    Returns
    -------
    The same parser; `parse_args` prints and exits when `--print-config` is given.
    """
    parser.add_argument("--help-config", action=_HelpConfigAction, config_cls=config_cls,
                        help="list every settings key with its type, default and meaning, then exit")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved settings (YAML file + --set overrides) as YAML, then exit")
    original = parser.parse_known_args

    def parse_known_args(args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        ns, rest = original(args, namespace)
        if getattr(ns, "print_config", False):
            from finetune.utils.config_utils import dump_config

            print(dump_config(load_fn(getattr(ns, "config", None), getattr(ns, "set", None) or ())), end="")
            parser.exit(0)
        return ns, rest

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    return parser


def config_kind(kind: str) -> tuple[type, Callable[[str | None, Sequence[str]], Any], str]:
    """(settings class, loader, default --config) of a pipeline: 'csv' or 'qlib'."""
    if kind == "csv":
        import finetune_csv.config as csv_config
        from finetune_csv.config import load_csv_config

        return csv_config.CsvFinetuneConfig, load_csv_config, None
    if kind == "qlib":
        from finetune.config import QlibConfig
        from finetune.config import load as load_qlib_config

        return QlibConfig, load_qlib_config, "configs/qlib_csi300.yaml"
    raise ValueError(f"unknown settings kind {kind!r} (expected 'csv' or 'qlib')")


def run_config_flags(prog: str, kind: str, argv: Sequence[str]) -> int:
    """Handle `--help-config` / `--print-config` for `kronos <command>` (exits through argparse like --help).

    Parameters
    ----------
    prog: program name shown in messages, e.g. `kronos finetune`.
    kind: 'csv' or 'qlib' (which settings).
    argv: the command's arguments; other options than --config/--set are ignored here.

    Returns
    -------
    0 (argparse raises SystemExit(0) after printing; `run_main` turns that into the exit code).
    """
    cls, load_fn, default_config = config_kind(kind)
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    parser.add_argument("--config", default=default_config)
    parser.add_argument("--set", dest="set", action="append", default=[])
    add_help_config_args(parser, cls, load_fn)
    parser.parse_known_args(list(argv))
    return 0


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
    "qlib-walk-forward": Command("finetune.qlib_walk_forward",
                                 "Qlib pipeline: rolling retrains over test periods, finetuned vs zero-shot verdict",
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
        from finetune.cli import run_config_flags

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
            from finetune_csv.config import translated_argv

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
