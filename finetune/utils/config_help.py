"""Self-documenting settings: every YAML key of a config dataclass with its type, default and docstring.

The docstrings are the one-line string literals under each field (read with `ast`, so they need not be repeated
anywhere). Entry points expose them as flags:

    parser = add_help_config_args(parser, CsvFinetuneConfig, csv_config.load)
    # --help-config   prints every key (type, default, meaning) and exits, like --help
    # --print-config  prints the resolved settings (YAML file + --set overrides) as YAML and exits

`kronos <command> --help-config` / `--print-config` use `run_config_flags`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

__all__ = ["KeyDoc", "describe_config", "format_config_help", "add_help_config_args", "run_config_flags"]


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
        from finetune_csv import config as csv_config
        from finetune_csv.legacy_config import load_csv_config

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
