"""Settings: typed dataclasses filled from YAML and `--set a.b=value`, one ConfigError for all problems
(`load_config` = `read_yaml` + `build_config`; `Problems` for a pipeline's own rules; export by `config_to_dict` /
`dump_config`). The rules for `--set` values and `{name}` templates: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import difflib
import math
import re
import reprlib
import types
import typing
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from model.errors import ConfigError, PathError

T = TypeVar("T")

_TEMPLATE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.]*)\}")


class Problems:
    """Collects configuration problems so that all of them are reported in one `ConfigError`.

        problems = Problems()
        problems.check(cfg.training.epochs > 0, "training.epochs", f"must be > 0, got {cfg.training.epochs}")
        problems.raise_if_any()"""

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

    def raise_if_any(self) -> None:
        """Raise one `ConfigError` listing every collected problem (does nothing when there are none)."""
        if self.items:
            raise ConfigError(self.items, self.title)


def read_yaml(yaml_path: str | Path | None) -> dict[str, Any]:
    """The mapping in a YAML settings file ({} for None or an empty file); PathError / ConfigError otherwise."""
    if yaml_path is None:
        return {}
    path = Path(yaml_path)
    if not path.is_file():
        raise PathError(f"config file not found: {path} (check --config)")
    loaded = _load_bounded(path)
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of settings, got {type(loaded).__name__}"])
    return loaded or {}


def load_config(cls: type[T], yaml_path: str | Path | None = None, overrides: Iterable[str] = ()) -> T:
    """Build the dataclass `cls` from a YAML file (optional; missing keys keep their defaults), then `a.b=value`
    overrides (YAML scalars; a `str` field takes the raw text, see above). Raises `ConfigError` naming every bad
    key; `PathError` if `yaml_path` does not exist."""
    return build_config(cls, read_yaml(yaml_path), overrides, str(yaml_path) if yaml_path is not None else None)


def build_config(cls: type[T], raw: Mapping[str, Any], overrides: Iterable[str] = (), source: str | None = None,
                 values: Mapping[str, Any] | None = None) -> T:
    """`load_config` on a mapping already read (`source` names it in the error title); `values` {dotted key:
    value} are applied after the overrides, typed as they are."""
    raw = dict(raw)
    problems = Problems(f"Invalid configuration from {source or '<defaults>'}")
    for key, value in parse_overrides(overrides, problems, keep_text=True):
        set_dotted(raw, key, value, problems)
    for key, value in (values or {}).items():  # typed values from Python (the CSV API): no text round trip
        set_dotted(raw, key, value, problems)
    cfg = _build(cls, raw, "", problems)
    if not problems:
        _resolve_templates(cfg, problems)
    problems.raise_if_any()
    return cfg


def parse_date(text: Any, key: str, problems: Problems, advice: str = "use YYYY-MM-DD") -> Any:
    """pandas.Timestamp of the date setting `text`, or None after recording a problem for `key`."""
    import pandas as pd  # only when a date is checked: loading settings needs no pandas

    try:
        ts = pd.Timestamp(str(text))
    except (ValueError, TypeError):
        ts = pd.NaT
    if ts is pd.NaT:
        problems.add(key, f"{text!r} is not a date ({advice})")
        return None
    return ts


def get_dotted(node: Any, key: str, default: Any = None) -> Any:
    """The value at dotted `key` ("a.b.c") in nested mappings and/or dataclasses; `default` when absent."""
    for part in key.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif dataclasses.is_dataclass(node) and not isinstance(node, Mapping) and hasattr(node, part):
            node = getattr(node, part)
        else:
            return default
    return node


def set_dotted(raw: dict, key: str, value: Any, problems: Problems | None = None) -> None:
    """Set dotted `key` in the nested mapping `raw`, creating sections; a value in the way is a problem."""
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            message = f"is a value, not a section (while applying --set {key}=...)"
            if problems is None:
                raise ConfigError([f"{'.'.join(parts[: i + 1])}: {message}"])
            problems.add(".".join(parts[: i + 1]), message)
            return
        node = child
    node[parts[-1]] = value


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


def parse_overrides(overrides: Iterable[str], problems: Problems | None = None, keep_text: bool = False
                    ) -> list[tuple[str, Any]]:
    """Parse `["training.epochs=3", ...]` into `[("training.epochs", 3), ...]` (values as YAML scalars);
    `keep_text`: each value an `_Override` that also keeps its raw text, for `str` fields."""
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
        parsed.append((key, _Override(text.strip(), value) if keep_text else value))
    if own:
        problems.raise_if_any()
    return parsed


def _build(cls: type, raw: Any, prefix: str, problems: Problems) -> Any:
    """Instantiate dataclass `cls` from the mapping `raw`; problems are recorded with dotted keys."""
    raw = _plain(raw) if isinstance(raw, _Override) else raw
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problems.add(prefix or "<top level>", f"expected a mapping of settings for {cls.__name__}, got {_show(raw)}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean '{_join(prefix, close[0])}'? " if close else ""
            problems.add(_join(prefix, str(key)), f"unknown key ({hint}known keys here: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in raw:
            kwargs[name] = convert(raw[name], hints[name], key, problems)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if dataclasses.is_dataclass(hints[name]):
                kwargs[name] = _build(hints[name], {}, key, problems)
            else:
                problems.add(key, "missing required value")
    try:
        return cls(**kwargs)
    except Exception:
        if not problems:
            raise
        return None  # a missing or half-converted value broke the constructor: the caller raises the problems


def convert(value: Any, tp: Any, key: str, problems: Problems) -> Any:
    """Check/convert one YAML value against the annotation `tp` (int, float, bool, str, Optional, list, Literal...):
    the loader's check, also of a setting given in code (schema.validate_training_config)."""
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
            return convert(value, non_none[0], key, problems)
        for a in non_none:  # first alternative that accepts the value without problems
            trial = Problems()
            out = convert(value, a, key, trial)
            if not trial:
                return out
        problems.add(key, f"expected {type_name(tp)}, got {_show(value)}")
        return value
    if origin is Literal:
        if value not in args:
            choices = " | ".join(repr(a) for a in args)
            problems.add(key, f"expected one of {choices}, got {_show(value)}")
        return value
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.add(key, f"expected {type_name(tp)}, got {_show(value)}")
            return value
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                problems.add(key, f"expected {len(args)} values ({type_name(tp)}), got {len(value)}")
                return tuple(value)
            return tuple(convert(v, a, f"{key}[{i}]", problems) for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        out = [convert(v, item_tp, f"{key}[{i}]", problems) for i, v in enumerate(value)]
        return tuple(out) if (origin is tuple or tp is tuple) else out
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            problems.add(key, f"expected a mapping, got {_show(value)}")
            return value
        vt = args[1] if len(args) == 2 else Any
        return {k: convert(v, vt, f"{key}.{k}", problems) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            problems.add(key, f"expected bool (true/false), got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.add(key, f"expected int, got {_show(value)}")
        elif _SEED.search(key) and not 0 <= value < 2**32:  # numpy's and torch's seeds: one rule for every seed
            problems.add(key, f"must be a seed in [0, 2**32 - 1], got {value}")
        elif not _SEED.search(key) and value > (cap := COUNT_CAPS.get(key.rsplit(".", 1)[-1], MAX_COUNT)):
            problems.add(key, f"must be <= {cap:_} (no real run needs more), got {value}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string: accept it when clearly a number
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.add(key, f"expected float, got {_show(value)}")
            return value
        if not math.isfinite(value):  # inf / nan: no setting means them (a rate, a ratio, a clip)
            problems.add(key, f"must be a finite number, got {value}")
        return float(value)
    if tp is str:
        if isinstance(value, datetime.date):  # YAML reads an unquoted 2024-07-01 as a date: keep it as ISO text
            return value.isoformat()
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


_SEED = re.compile(r"(^|\.)seeds?(\[\d+\])?$")
# Upper bounds of count settings (a typo like epochs 1000000000000 would run until killed): every int setting is
# <= MAX_COUNT, the loop counts below by name.
MAX_COUNT = 10**9
# sample_count takes MAX_COUNT: the memory check (forecast's check_memory) refuses far less, naming the GiB it needs.
COUNT_CAPS = {"epochs": 100_000, "n_trials": 100_000, "folds": 10_000, "inner_folds": 10_000,
              "lookback": 1_000_000, "predict": 1_000_000}
_SHORT = reprlib.Repr()
# At most ~5 items per level and 3 levels: the text stays short (and cheap) even for a value built from thousands
# of YAML aliases, which a full repr would expand to gigabytes before it could be cut.
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 3, 5, 5, 5
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 60, 60, 40


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


def _show(value: Any) -> str:
    if isinstance(value, str):
        return _SHORT.repr(value)
    if value is None:
        return "null"
    if isinstance(value, (Mapping, list, tuple)):
        return f"{type(value).__name__} {_SHORT.repr(value)}"[:80]
    return f"{_SHORT.repr(value)} ({type(value).__name__})"


MAX_CONFIG_BYTES = 1 << 20  # a larger settings file (1 MiB) is refused before parsing: configs are a few KiB
MAX_YAML_ALIASES = 100  # aliases (`*name`) allowed in one file; a "billion laughs" file nests thousands of them
MAX_YAML_DEPTH = 32  # nested mappings/lists; the settings nest 3 deep, and 10,000 would exhaust Python's stack


class _BoundedLoader(yaml.SafeLoader):
    """The pure-Python safe loader (the C one composes in C), counting aliases (past MAX_YAML_ALIASES) and depth
    (past MAX_YAML_DEPTH), refusing duplicate keys and integers beyond 64 bits: one ConfigError line each."""

    def _refuse(self, node: Any, problem: str) -> None:
        raise ConfigError([f"{self.name} line {node.start_mark.line + 1}: {problem}"])

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:  # a key written twice: the last one would silently win
            key = self.construct_object(key_node)
            if isinstance(key, Hashable) and key in seen:  # (the base class names an unhashable key)
                self._refuse(key_node, f"the key {key!r} appears twice in one mapping; keep one")
            seen.add(key if isinstance(key, Hashable) else id(key))
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: Any) -> int:
        value = super().construct_yaml_int(node)
        if abs(value) >= 2**63:  # no setting takes one; torch and numpy would overflow on it
            self._refuse(node, f"the integer {node.value[:24]} is beyond 64 bits; no setting takes such a number")
        return value

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth > MAX_YAML_DEPTH:
            self._refuse(self.peek_event(), f"nested more than {MAX_YAML_DEPTH} levels deep; settings nest a few")
        if self.check_event(yaml.AliasEvent):
            self._aliases = getattr(self, "_aliases", 0) + 1
            if self._aliases > MAX_YAML_ALIASES:
                self._refuse(self.peek_event(), f"more than {MAX_YAML_ALIASES} YAML aliases (*name); a settings "
                             "file needs few; write the values out")
        node = super().compose_node(parent, index)
        self._depth -= 1
        return node


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _load_bounded(path: Path) -> Any:
    """The YAML document in `path`, safely: size and aliases bounded before anything is built (ConfigError)."""
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError([f"{path}: {size} bytes is too large for a settings file (at most {MAX_CONFIG_BYTES})"])
    if b"\0" in path.read_bytes():
        raise ConfigError([f"{path}: a binary file, not a YAML settings file (it holds NUL bytes)"])
    with open(path, encoding="utf-8") as f:
        loader = _BoundedLoader(f)
        loader.name = str(path)
        try:
            return loader.get_single_data()
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError([f"{path}: not valid YAML ({e})"]) from None
        finally:
            loader.dispose()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _resolve_templates(cfg: Any, problems: Problems) -> None:
    """Replace `{name}` / `{a.b}` in string fields by the values of other fields (repeated until stable)."""
    for _ in range(10):  # chains like a -> b -> c resolve in a few passes; more means a cycle
        left: list[tuple[str, str]] = []  # (key, name) of every template this pass left in place
        changed = _resolve_pass(cfg, cfg, "", problems, left)
        if problems or not changed:
            break
    else:
        problems.add("<templates>", "templates refer to each other in a cycle")
        return
    for key, name in left:
        problems.add(key, f"template {{{name}}} could not be resolved (it refers to itself or a cycle)")


def _resolve_pass(root: Any, node: Any, prefix: str, problems: Problems, left: list[tuple[str, str]]) -> bool:
    changed = False
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = _join(prefix, f.name)
        if dataclasses.is_dataclass(value):
            changed |= _resolve_pass(root, value, key, problems, left)
        elif isinstance(value, str) and _TEMPLATE.search(value):

            def lookup(m: re.Match, key=key) -> str:
                found, ref = _lookup(root, node, m.group(1))
                if not found:
                    problems.add(key, f"template {{{m.group(1)}}} names no setting")
                elif not (isinstance(ref, str) and _TEMPLATE.search(ref)):
                    return str(ref)
                left.append((key, m.group(1)))  # unknown, or a template itself: resolve that field first (next pass)
                return m.group(0)

            new = _TEMPLATE.sub(lookup, value)
            if new != value:
                setattr(node, f.name, new)
                changed = True
    return changed


def _lookup(root: Any, section: Any, name: str) -> tuple[bool, Any]:
    for start in ((section, root) if "." not in name else (root,)):
        obj = start
        for part in name.split("."):
            if not (dataclasses.is_dataclass(obj) and any(f.name == part for f in dataclasses.fields(obj))):
                break
            obj = getattr(obj, part)
        else:  # every part named a field: a value, not a section
            if not dataclasses.is_dataclass(obj):
                return True, obj
    return False, None


def config_to_dict(cfg: Any, strict: bool = False) -> Any:
    """Plain nested dict (JSON/YAML-safe: Paths become str, tuples become lists) of a config dataclass; `strict`:
    every value that is not str/int/float/bool/None becomes its str too."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_to_dict(getattr(cfg, f.name), strict) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return {str(k): config_to_dict(v, strict) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(v, strict) for v in cfg]
    if isinstance(cfg, Path) or (strict and not (cfg is None or isinstance(cfg, (str, int, float, bool)))):
        return str(cfg)
    return cfg


def dump_config(cfg: Any) -> str:
    """The config as YAML text (loads back with `load_config`)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def plain(obj: Any) -> Any:
    """Config data reduced to str/int/float/bool/None/list/dict (so the checkpoint loads with weights_only=True)."""
    return config_to_dict(obj, strict=True)
