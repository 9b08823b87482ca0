"""Typed configuration: nested dataclasses filled from YAML, `--set a.b=value` overrides, one error for all problems.

Each pipeline declares its settings as nested dataclasses (a one-line docstring per field) and loads them with
`load_config(cls, yaml_path, overrides)`. The YAML file holds one mapping per nested dataclass:

    training:
      epochs: 10
      lr: 4.0e-5

Every problem found while loading (unknown keys, wrong types, missing required values, bad templates) is collected
and raised once as a `ConfigError` (a `ValueError`) that names each YAML key, e.g.
`training.epochs: expected int, got 'ten'`. Pipelines validate their own semantic rules with `Problems`, which
raises the same error type.

`--set` values are read as YAML scalars (`3` -> int, `null` -> None), except for a field typed `str`, which takes
the raw text: `--set "data.columns.timestamps=Unnamed: 0"` is the column name `Unnamed: 0`, not a YAML mapping.

String fields may refer to other fields with `{name}` templates, e.g. `output_dir: outputs/{exp_name}` or
`save_dir: {training.output_dir}/tokenizer`; a bare name is looked up in the same section first, then at the top.

(Over 400 lines on purpose: YAML reading, --set parsing, type conversion and templates are one loading pipeline
whose steps share private helpers; splitting them would only spread one concept over several files.)
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

__all__ = [
    "ConfigError",
    "Problems",
    "load_config",
    "parse_overrides",
    "add_config_args",
    "config_from_args",
    "config_to_dict",
    "dump_config",
]

T = TypeVar("T")

_TEMPLATE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.]*)\}")


class ConfigError(ValueError):
    """Invalid settings; `.problems` lists one `"yaml.key: what is wrong"` line per problem."""

    def __init__(self, problems: Sequence[str], title: str = "Invalid configuration"):
        self.problems = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{title} ({n} problem{'s' if n != 1 else ''}):\n{lines}")


class Problems:
    """Collects configuration problems so that all of them are reported in one `ConfigError`.

        problems = Problems()
        problems.check(cfg.training.epochs > 0, "training.epochs", f"must be > 0, got {cfg.training.epochs}")
        problems.raise_if_any()
    """

    def __init__(self, title: str = "Invalid configuration"):
        self.title = title
        self.items: list[str] = []

    def add(self, key: str, message: str) -> None:
        """Record that the setting `key` (a dotted YAML key) is wrong, and how to fix it."""
        self.items.append(f"{key}: {message}" if key else message)

    def check(self, ok: bool, key: str, message: str) -> bool:
        """Record `message` for `key` unless `ok`; returns `ok` so dependent checks can be skipped."""
        if not ok:
            self.add(key, message)
        return bool(ok)

    def extend(self, other: Problems | Iterable[str]) -> None:
        """Append problems collected elsewhere (another `Problems` or plain `"key: message"` strings)."""
        self.items.extend(other.items if isinstance(other, Problems) else other)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def raise_if_any(self) -> None:
        """Raise one `ConfigError` listing every collected problem (does nothing when there are none)."""
        if self.items:
            raise ConfigError(self.items, self.title)


# ----------------------------------------------------------------------------------------------------------------
# loading


def load_config(cls: type[T], yaml_path: str | Path | None = None, overrides: Iterable[str] = ()) -> T:
    """Build the dataclass `cls` from a YAML file (optional) and `a.b=value` overrides (applied after the file).

    Fields missing from the YAML keep their defaults. Override values are parsed as YAML scalars
    (`3` -> int, `1e-4` -> float, `true` -> bool, `null` -> None, `[0.9, 0.95]` -> list), except that a `str`
    field takes the override's raw text (a `str | None` field: `null` is None, anything else the raw text).
    Raises `ConfigError` (a ValueError) naming every bad key; `FileNotFoundError` if `yaml_path` does not exist.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"load_config expects a dataclass type, got {cls!r}")
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path} (check --config)")
        source = str(path)
        with open(path, encoding="utf-8") as f:
            try:
                loaded = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ConfigError([f"{path}: not valid YAML ({e})"]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError([f"{path}: the top level must be a mapping of settings, got {type(loaded).__name__}"])
        raw = loaded

    problems = Problems(f"Invalid configuration from {source}")
    for key, value in _parse_overrides(overrides, problems):
        _set_dotted(raw, key, value, problems)
    cfg = _build(cls, raw, "", problems)
    if not problems:
        _resolve_templates(cfg, problems)
    problems.raise_if_any()
    return cfg


@dataclasses.dataclass(frozen=True)
class _Override:
    """A `--set` value until its field's type is known: the raw text and its YAML reading."""

    text: str
    value: Any


def _resolve_override(value: Any, tp: Any) -> Any:
    """The text of an override for a `str` / `Path` field (or a union with str unless the YAML reading is null),
    else its YAML reading; any other value unchanged. Quoted text (`"a b"`) is unquoted as YAML does."""
    if not isinstance(value, _Override):
        return value
    union = typing.get_origin(tp) in (Union, types.UnionType)
    wants_text = tp in (str, Path) or (union and str in typing.get_args(tp) and value.value is not None)
    if not wants_text:
        return value.value
    quoted = len(value.text) >= 2 and value.text[0] == value.text[-1] and value.text[0] in "'\""
    return value.value if quoted and isinstance(value.value, str) else value.text


def _plain(value: Any) -> Any:
    """The YAML reading of an override, recursively (for values that reach untyped containers)."""
    if isinstance(value, _Override):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _parse_overrides(overrides: Iterable[str], problems: Problems) -> list[tuple[str, _Override]]:
    """`parse_overrides`, keeping each value's raw text for `str` fields."""
    out = []
    for item in overrides or ():
        key, sep, text = item.partition("=")
        parsed = parse_overrides([item], problems)
        if parsed:
            out.append((parsed[0][0], _Override(text.strip(), parsed[0][1])))
    return out


def parse_overrides(overrides: Iterable[str], problems: Problems | None = None) -> list[tuple[str, Any]]:
    """Parse `["training.epochs=3", ...]` into `[("training.epochs", 3), ...]` (values as YAML scalars)."""
    own = problems is None
    problems = Problems("Invalid --set override") if own else problems
    parsed = []
    for item in overrides or ():
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.add(f"--set {item}", "expected KEY=VALUE, e.g. --set training.epochs=3")
            continue
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text  # not YAML: keep the raw string, type checking will complain if a string is wrong here
        if not isinstance(value, str) and _TEMPLATE.search(text):
            value = text  # `{exp_name}/x` is a template, not a YAML flow mapping
        parsed.append((key, value))
    if own:
        problems.raise_if_any()
    return parsed


def _set_dotted(raw: dict, key: str, value: Any, problems: Problems) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            problems.add(".".join(parts[: i + 1]), f"is a value, not a section (while applying --set {key}=...)")
            return
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str, problems: Problems) -> Any:
    """Instantiate dataclass `cls` from the mapping `raw`; problems are recorded with dotted keys."""
    where = prefix or "<top level>"
    raw = _plain(raw) if isinstance(raw, _Override) else raw
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problems.add(where, f"expected a mapping of settings for {cls.__name__}, got {_show(raw)}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if key not in fields:
            known = ", ".join(sorted(fields))
            problems.add(_join(prefix, str(key)), f"unknown key (known keys here: {known})")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in raw:
            kwargs[name] = _convert(raw[name], hints[name], key, problems)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if dataclasses.is_dataclass(hints[name]):
                kwargs[name] = _build(hints[name], {}, key, problems)
            else:
                problems.add(key, "missing required value")
    if len(problems):
        # Do not call the constructor with half-converted values; the caller raises anyway.
        try:
            return cls(**kwargs)
        except Exception:
            return None
    return cls(**kwargs)


def _convert(value: Any, tp: Any, key: str, problems: Problems) -> Any:
    """Check/convert one YAML value against the annotation `tp` (int, float, bool, str, Optional, list, ...)."""
    value = _resolve_override(value, tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return _plain(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, problems)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _convert(value, non_none[0], key, problems)
        for a in non_none:  # first alternative that accepts the value without problems
            trial = Problems()
            out = _convert(value, a, key, trial)
            if not trial:
                return out
        problems.add(key, f"expected {_type_name(tp)}, got {_show(value)}")
        return value
    if origin is Literal:
        if value not in args:
            choices = " | ".join(repr(a) for a in args)
            problems.add(key, f"expected one of {choices}, got {_show(value)}")
        return value
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.add(key, f"expected {_type_name(tp)}, got {_show(value)}")
            return value
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                problems.add(key, f"expected {len(args)} values ({_type_name(tp)}), got {len(value)}")
                return tuple(value)
            return tuple(_convert(v, a, f"{key}[{i}]", problems) for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        out = [_convert(v, item_tp, f"{key}[{i}]", problems) for i, v in enumerate(value)]
        return tuple(out) if (origin is tuple or tp is tuple) else out
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            problems.add(key, f"expected a mapping, got {_show(value)}")
            return value
        vt = args[1] if len(args) == 2 else Any
        return {k: _convert(v, vt, f"{key}.{k}", problems) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            problems.add(key, f"expected bool (true/false), got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.add(key, f"expected int, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads `1e-4` (no dot) as a string: accept it when it is clearly a number.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            problems.add(key, f"expected float, got {_show(value)}")
            return value
        return float(value)
    if tp is str:
        if isinstance(value, Mapping) and value and all(v is None for v in value.values()):
            problems.add(key, f"expected str, got {_show(value)}; quote templates in YAML: \"{{{next(iter(value))}}}\"")
        elif not isinstance(value, str):
            problems.add(key, f"expected str, got {_show(value)}")
        return value
    if tp is Path:
        if not isinstance(value, (str, Path)):
            problems.add(key, f"expected a path (str), got {_show(value)}")
            return value
        return Path(value)
    return value  # an annotation we do not check (e.g. a custom class): trust the pipeline's validate()


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp) if a is not Ellipsis)
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if value is None:
        return "null"
    if isinstance(value, (Mapping, list, tuple)):
        return f"{type(value).__name__} {value!r}"[:80]
    return f"{value!r} ({type(value).__name__})"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# ----------------------------------------------------------------------------------------------------------------
# templates


def _resolve_templates(cfg: Any, problems: Problems) -> None:
    """Replace `{name}` / `{a.b}` in string fields by the values of other fields (repeated until stable)."""
    for _ in range(10):  # chains like a -> b -> c resolve in a few passes; more means a cycle
        changed = _resolve_pass(cfg, cfg, "", problems)
        if problems or not changed:
            break
    else:
        problems.add("<templates>", "templates refer to each other in a cycle")
        return
    for key, text in _strings(cfg, ""):
        for name in _TEMPLATE.findall(text):
            problems.add(key, f"template {{{name}}} could not be resolved (it refers to itself or a cycle)")


def _resolve_pass(root: Any, node: Any, prefix: str, problems: Problems) -> bool:
    changed = False
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = _join(prefix, f.name)
        if dataclasses.is_dataclass(value):
            changed |= _resolve_pass(root, value, key, problems)
        elif isinstance(value, str) and _TEMPLATE.search(value):

            def lookup(m: re.Match, key=key) -> str:
                found, ref = _lookup(root, node, m.group(1))
                if not found:
                    problems.add(key, f"template {{{m.group(1)}}} names no setting")
                    return m.group(0)
                if isinstance(ref, str) and _TEMPLATE.search(ref):
                    return m.group(0)  # resolve the referenced field first (next pass)
                return str(ref)

            new = _TEMPLATE.sub(lookup, value)
            if new != value:
                setattr(node, f.name, new)
                changed = True
    return changed


def _lookup(root: Any, section: Any, name: str) -> tuple[bool, Any]:
    for start in ((section, root) if "." not in name else (root,)):
        obj, ok = start, True
        for part in name.split("."):
            if dataclasses.is_dataclass(obj) and any(f.name == part for f in dataclasses.fields(obj)):
                obj = getattr(obj, part)
            else:
                ok = False
                break
        if ok and not dataclasses.is_dataclass(obj):
            return True, obj
    return False, None


def _strings(node: Any, prefix: str) -> Iterable[tuple[str, str]]:
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = _join(prefix, f.name)
        if dataclasses.is_dataclass(value):
            yield from _strings(value, key)
        elif isinstance(value, str):
            yield key, value


# ----------------------------------------------------------------------------------------------------------------
# command line and export


def add_config_args(parser: argparse.ArgumentParser, default_config: str | None = None) -> argparse.ArgumentParser:
    """Add `--config PATH` and repeatable `--set KEY=VALUE` to `parser`; returns the parser."""
    parser.add_argument(
        "--config",
        default=default_config,
        required=default_config is None,
        help="YAML file with the settings" + (f" (default: {default_config})" if default_config else ""),
    )
    parser.add_argument(
        "--set",
        dest="set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting, e.g. --set training.epochs=3 (repeatable; values are YAML scalars)",
    )
    return parser


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """`load_config(cls, args.config, args.set)` for a parser prepared with `add_config_args`."""
    return load_config(cls, getattr(args, "config", None), getattr(args, "set", None) or ())


def config_to_dict(cfg: Any) -> Any:
    """Plain nested dict (JSON/YAML-safe: Paths become str, tuples become lists) of a config dataclass."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return {str(k): config_to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def dump_config(cfg: Any) -> str:
    """The config as YAML text (loads back with `load_config`)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
