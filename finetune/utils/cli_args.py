"""The command line of every entry point with settings (`add_config_args`, `parse_config_args`, `add_run_flags`)
and the self-documenting settings behind --help-config (`describe_config`, `format_config_help`); docs/architecture.md,
"Formats and designs"."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from finetune.utils.config_utils import dump_config, type_name


def add_config_args(parser: argparse.ArgumentParser, config_cls: type,
                    load_fn: Callable[[str | None, Sequence[str]], Any],
                    default_config: str | None = None) -> argparse.ArgumentParser:
    """Add `--config`, repeatable `--set KEY=VALUE`, `--help-config` (the keys of `config_cls`) and `--print-config`
    (calls the pipeline's `load_fn(path, overrides)`: exactly what a run would use, failing the same way)."""
    parser.add_argument("--config", default=default_config, required=default_config is None,
                        help=f"YAML file with the settings (default: {default_config})" if default_config
                        else "YAML file with the settings")
    parser.add_argument("--set", dest="set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting, e.g. --set training.epochs=3 (repeatable; values are YAML scalars)")
    parser.add_argument("--help-config", action=_HelpConfigAction, config_cls=config_cls,
                        help="list every settings key with its type, default and meaning, then exit")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved settings (YAML file + --set overrides) as YAML, then exit")
    parser.set_defaults(load_config_fn=load_fn)
    return parser


def parse_config_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)` of a parser prepared by `add_config_args`; `--print-config` prints and exits."""
    args = parser.parse_args(argv)
    if args.print_config:
        print(dump_config(args.load_config_fn(args.config, list(args.set) + run_overrides(args))), end="")
        parser.exit(0)
    return args


def add_run_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--resume` and `--overwrite` of the training commands (each sets one `training.` key, see `run_overrides`)."""
    parser.add_argument("--resume", action="store_true",
                        help="insist on resuming: an unfinished stage continues from its newest checkpoint, and it "
                             "is an error if there is none (training.resume=required; the default 'auto' resumes "
                             "when it can and starts fresh otherwise)")
    parser.add_argument("--overwrite", action="store_true",
                        help="retrain a stage folder that already holds a run, replacing its outputs "
                             "(training.overwrite=true; a finished stage is otherwise skipped)")
    return parser


def run_overrides(args: argparse.Namespace) -> list[str]:
    """The `--set` items that `--resume` / `--overwrite` stand for (none when the parser has no such flags)."""
    return ((["training.resume=required"] if getattr(args, "resume", False) else [])
            + (["training.overwrite=true"] if getattr(args, "overwrite", False) else []))


class _HelpConfigAction(argparse.Action):
    """`--help-config`: print every key and exit (like --help, before required arguments are checked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, config_cls: type, **kwargs: Any):
        self.config_cls = config_cls
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(format_config_help(self.config_cls))
        parser.exit(0)


# self-documenting settings: every key's type, default and docstring (the string literal under each field)

@dataclass(frozen=True)
class KeyDoc:
    """One leaf setting: dotted `key` (`training.epochs`), readable `type` (`float | null`), `default` (what a YAML
    file that leaves the key out gets) and the field's docstring `doc` ('' when it has none)."""

    key: str
    type: str
    default: Any
    doc: str


@dataclass(frozen=True)
class SectionDoc:
    """A nested dataclass (one YAML mapping): dotted `key` and `doc`, its field docstring, else the class docstring's
    first line."""

    key: str
    doc: str


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
    body = ast.parse(source).body[0].body  # the class statement (its decorators belong to it)
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def describe_config(cls: type, prefix: str = "") -> list[KeyDoc | SectionDoc]:
    """Every section and leaf key of dataclass `cls`: a section's own keys, then its subsections (depth first)."""
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
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _show_default(value: Any) -> str:
    """A default as it would be written in YAML (null, true, "text", [a, b]): JSON is YAML's flow style."""
    return "(required)" if value is dataclasses.MISSING else json.dumps(value, default=repr)


def format_config_help(cls: type) -> str:
    """The listing `--help-config` prints: sections as headers, then `key: type = default` and its docstring."""
    lines = [f"Settings of {cls.__name__} (YAML keys; override any with --set KEY=VALUE):"]
    for item in describe_config(cls):
        if isinstance(item, SectionDoc):
            lines += ["", f"{item.key}:" + (f"  # {item.doc}" if item.doc else "")]
            continue
        lines.append(f"  {item.key}: {item.type} = {_show_default(item.default)}")
        if item.doc:
            lines += textwrap.wrap(item.doc, width=118, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)
