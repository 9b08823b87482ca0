"""Settings: typed dataclasses filled from YAML and `--set a.b=value`, one ConfigError for all problems.

What this module owns:
- Loading (`load_config` = `read_yaml` + `build_config`): unknown keys (with a "did you mean"), wrong types and
  missing values are collected and raised once as a `ConfigError` naming each YAML key, e.g.
  `training.epochs: expected int, got 'ten'`. Pipelines add their own rules with `Problems`.
  `--set` values are YAML scalars (`3` -> int, `null` -> None), except for a `str` field, which takes the raw text
  (`--set "data.columns.timestamps=Unnamed: 0"`). String fields may use `{name}` / `{a.b}` templates
  (`base_dir: outputs/{exp_name}`): a bare name is looked up in the same section first, then at the top.
- Export: `config_to_dict` / `dump_config` (what --print-config prints and run_info.json records).
- The shared sections: `TrainingConfig` (the loop's settings) and its validation, `StageConfig`
  (`tokenizer_training:` / `predictor_training:`), `SamplingConfig` (`forecast:` sampling), `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import importlib.util
import logging
import re
import reprlib
import types
import typing
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from finetune.utils.adapters import mode_problems
from model.config import KronosConfig, KronosTokenizerConfig
from model.errors import ConfigError, PathError
from model.features import FEATURES

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
    for key, value in _parse_overrides(overrides, problems):
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


def _parse_overrides(overrides: Iterable[str], problems: Problems) -> list[tuple[str, _Override]]:
    """`parse_overrides`, keeping each value's raw text for `str` fields."""
    return [(key, _Override(item.partition("=")[2].strip(), value)) for item in overrides or ()
            for key, value in parse_overrides([item], problems)]


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
            kwargs[name] = _convert(raw[name], hints[name], key, problems)
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


@dataclass
class TrainingConfig:
    """Settings of the shared training loop (a `training:`-style YAML section in both pipelines)."""

    epochs: int = 30
    """Passes over the (possibly capped) training windows."""
    batch_size: int = 50
    """Windows per forward pass on EACH process; global batch = batch_size * world_size * accumulation_steps."""
    accumulation_steps: int = 1
    """Micro-batches whose gradients are summed before one optimizer step."""
    lr: float = 2e-4
    """Peak learning rate of the OneCycle schedule (reference: 2e-4 tokenizer, 4e-5 predictor)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (kept fixed: the schedule does not cycle momentum)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    pct_start: float = 0.03
    """Fraction of all optimizer steps spent warming the learning rate up to `lr`."""
    div_factor: float = 10.0
    """OneCycle: the first learning rate is lr / div_factor."""
    final_div_factor: float = 1e4
    """OneCycle: the last learning rate is lr / div_factor / final_div_factor."""
    clip_grad_norm: float | None = None
    """Max gradient norm; null = stage default (2.0 tokenizer, 3.0 predictor); 0 = no clipping."""
    amp: Literal["auto", "none", "bf16"] = "auto"
    """Mixed precision. 'auto': bfloat16 autocast on a CUDA GPU that supports it (torch.cuda.is_bf16_supported),
    else float32, with TF32 matmuls for what stays float32 on CUDA; float32 on CPU. 'none': float32 everywhere
    (TF32 off). 'bf16': bfloat16 autocast on CUDA (float32 on CPU). The train log says which ran and why."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the training loss (forward + backward) once per stage: 'auto' = on with CUDA, off on CPU;
    true / false. An epoch's ragged last micro-batch runs eagerly (static shapes); a compile that fails at the first
    step logs one warning and training goes on eagerly."""
    deterministic: bool = False
    """true: deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN
    deterministic, no cuDNN benchmark) and training.compile 'auto' runs eagerly, so on a GPU a resumed run equals the
    uninterrupted one bit for bit; slower. false: a GPU's atomics may differ run to run (on CPU both are exact)."""
    seed: int = 100
    """Base seed; each process uses seed + rank; data order depends on (seed, epoch) only."""
    num_workers: int = 2
    """DataLoader worker processes per rank (0 = load in the training process)."""
    max_train_samples: int | None = None
    """Windows drawn per training epoch (a fresh seeded subset each epoch; Qlib's n_train_iter); null = all."""
    max_val_samples: int | None = None
    """Windows drawn per validation (a fresh seeded subset each epoch; Qlib's n_val_iter); null = all."""
    log_every_steps: int = 10
    """Write a metrics.jsonl record every this many optimizer steps (and at each epoch's last step)."""
    save_every_steps: int = 0
    """Also write checkpoints/last.pt every this many optimizer steps (0 = only at the end of each epoch)."""
    patience: int = 0
    """Stop after this many epochs without a better validation loss (0 = never stop early)."""
    min_delta: float = 0.0
    """A validation loss counts as better only if it beats the best by more than this."""
    resume: str = "auto"
    """'auto' = continue an unfinished run in the output folder (skip a finished one); 'required' = the same but an
    error when there is nothing to resume; 'never' = start fresh (an error if the folder holds a run); or a path
    to a checkpoint file / run folder."""
    overwrite: bool = False
    """Replace a run already in the output folder (finished or not): its outputs are deleted once this run holds
    the folder's lock."""
    keep_checkpoints: int = 2
    """How many step checkpoints (checkpoints/step-*.pt) to keep; last.pt links to the newest."""
    accept_changed_data: bool = False
    """Resume even though the data (data_info fingerprint) or the frozen tokenizer's weights changed since the
    checkpoint; what changed is recorded in run_info.json."""
    select_by: str = "loss"
    """What picks best_model/ and drives early stopping: 'loss' (validation loss) or the name of a forecast metric
    the pipeline computes (e.g. 'crps'; lower is better)."""
    teacher_forcing: bool = True
    """Predictor: condition s2 on the true next s1 (false = on a sampled s1); validation always uses the true s1."""
    dist_timeout_s: float = 1800.0
    """Seconds a collective waits for the other ranks before the job fails instead of hanging."""
    progress_bar: bool = True
    """Show a tqdm progress bar (rank 0 only)."""
    tensorboard: bool = False
    """Also log to TensorBoard under <output_dir>/tensorboard (needs `pip install 'kronos-finetune[tensorboard]'`)."""
    mlflow: bool = False
    """Also log to MLflow: config as params, metrics per step, loss_curve.png and run_info.json (needs mlflow)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; null = an offline store sqlite:///<output_dir>/mlruns/mlflow.db in the stage folder."""
    mlflow_experiment: str = "kronos-finetune"
    """MLflow experiment name (created if missing)."""
    comet: bool = False
    """Also log to Comet (if comet_ml is installed and configured)."""
    comet_project: str = "kronos-finetune"
    """Comet project name."""
    finetune_mode: str = "full"
    """Predictor stage: 'full' trains every weight, 'lora' low-rank adapters (peft), 'freeze' only `trainable`."""
    lora_rank: int = 8
    """lora: rank r of each adapter (B (out, r) @ A (r, in))."""
    lora_alpha: float = 16.0
    """lora: the adapter's output is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """lora: dropout on the adapter's input while training."""
    lora_targets: list[str] = field(default_factory=lambda: ["attention"])
    """lora: layers that get adapters: groups attention, feed_forward, heads, or module names (e.g. q_proj, w1)."""
    trainable: list[str] = field(default_factory=list)
    """freeze: parameter-name prefixes that train, e.g. [head, transformer.1, embedding]; the rest is frozen.
    [] = the heads and the last transformer block."""


def validate_training_config(cfg: TrainingConfig, problems: Problems, prefix: str = "training") -> None:
    """Add every problem of `cfg` to `problems`, each named by its YAML key (`prefix.field`)."""
    k = (lambda name: f"{prefix}.{name}" if prefix else name)
    at_least_one = ("epochs", "batch_size", "accumulation_steps", "log_every_steps", "keep_checkpoints")
    positive = ("lr", "div_factor", "final_div_factor", "dist_timeout_s")
    non_negative = ("weight_decay", "num_workers", "save_every_steps", "min_delta")
    for names, ok, bound in ((at_least_one, lambda v: v >= 1, ">= 1"), (positive, lambda v: v > 0, "> 0"),
                             (non_negative, lambda v: v >= 0, ">= 0")):
        for name in names:
            problems.check(ok(getattr(cfg, name)), k(name), f"must be {bound}, got {getattr(cfg, name)}")
    problems.check(len(cfg.betas) == 2 and all(0 <= b < 1 for b in cfg.betas), k("betas"),
                   f"need two values in [0, 1), got {cfg.betas}")
    problems.check(0 < cfg.pct_start < 1, k("pct_start"), f"must be in (0, 1), got {cfg.pct_start}")
    problems.check(cfg.clip_grad_norm is None or cfg.clip_grad_norm >= 0, k("clip_grad_norm"),
                   f"must be >= 0 or null, got {cfg.clip_grad_norm}")
    problems.check(cfg.amp in ("auto", "none", "bf16"), k("amp"), f"must be 'auto', 'none' or 'bf16', got {cfg.amp!r}")
    problems.check(cfg.compile is True or cfg.compile is False or cfg.compile == "auto", k("compile"),
                   f"must be 'auto', true or false, got {cfg.compile!r}")
    for name in ("max_train_samples", "max_val_samples"):
        v = getattr(cfg, name)
        problems.check(v is None or v >= 1, k(name), f"must be >= 1 or null (all windows), got {v}")
    problems.check(cfg.patience >= 0, k("patience"), f"must be >= 0 (0 = no early stopping), got {cfg.patience}")
    problems.check(isinstance(cfg.select_by, str) and cfg.select_by.strip() != "", k("select_by"),
                   f"must be 'loss' or a metric name, got {cfg.select_by!r}")
    for name, message in mode_problems(cfg):  # the finetune modes' registry (finetune/utils/adapters.py)
        problems.add(k(name), message)
    for key, message in tracker_problems(tensorboard=cfg.tensorboard, mlflow=cfg.mlflow, comet=cfg.comet,
                                         prefix=prefix):
        problems.add(key, message)


def plain(obj: Any) -> Any:
    """Config data reduced to str/int/float/bool/None/list/dict (so the checkpoint loads with weights_only=True)."""
    return config_to_dict(obj, strict=True)


log = logging.getLogger("finetune.config")

STAGES = ("tokenizer", "predictor")


@dataclass
class StageConfig:
    """What one stage sets differently from `training:`; null = use the `training:` value."""

    epochs: int | None = None
    """Epochs of this stage; null = training.epochs (the CSV pipeline also takes 0 = skip this stage)."""
    lr: float | None = None
    """Peak learning rate of this stage; null = training.lr (reference finetuning: 2e-4 tokenizer, 4e-5 predictor)."""
    batch_size: int | None = None
    """Windows per micro-batch on each process; null = training.batch_size."""
    clip_grad_norm: float | None = None
    """Gradient-norm clip; null = training.clip_grad_norm, whose null means 2.0 (tokenizer) / 3.0 (predictor)."""


class StagedConfig:
    """Base of both pipelines' settings, which hold `training:` and the `tokenizer_training:` / `predictor_training:`
    StageConfig sections."""

    def stage_training(self, stage: Literal["tokenizer", "predictor"]) -> TrainingConfig:
        """`training` with the stage's non-null overrides applied: what the engine runs that stage with."""
        section = getattr(self, f"{stage}_training")
        changed = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
                   if getattr(section, f.name) is not None}
        return dataclasses.replace(self.training, **changed)

    def check_training(self, problems: Problems, select_by: Mapping[str, str], min_epochs: int = 1) -> None:
        """Add the problems of `training:` and of both stage sections (each value may be null = inherit); `select_by`
        maps each allowed training.select_by to what it selects by."""
        validate_training_config(self.training, problems, "training")
        choices = " or ".join(f"'{name}' ({meaning})" for name, meaning in select_by.items())
        problems.check(self.training.select_by in select_by, "training.select_by",
                       f"must be {choices}, got {self.training.select_by!r}")
        for k in ("tokenizer_training", "predictor_training"):
            s = getattr(self, k)
            problems.check(s.epochs is None or s.epochs >= min_epochs, f"{k}.epochs",
                           f"must be >= {min_epochs} or null, got {s.epochs}")
            problems.check(s.lr is None or s.lr > 0, f"{k}.lr", f"must be > 0 or null, got {s.lr}")
            problems.check(s.batch_size is None or s.batch_size >= 1, f"{k}.batch_size",
                           f"must be >= 1 or null, got {s.batch_size}")
            problems.check(s.clip_grad_norm is None or s.clip_grad_norm >= 0, f"{k}.clip_grad_norm",
                           f"must be >= 0 or null, got {s.clip_grad_norm}")


def stage_key(run_config: Mapping[str, Any] | None, stage: str, name: str) -> str:
    """The YAML key that sets loop setting `name` for `stage` in the pipeline's resolved config `run_config`:
    `<stage>_training.<name>` when that section sets it (it shadows `training:`), else `training.<name>`."""
    section = (run_config or {}).get(f"{stage}_training") or {}
    return f"{stage}_training.{name}" if section.get(name) is not None else f"training.{name}"


def warn_shadowed_overrides(cfg: Any, overrides: Iterable[str]) -> None:
    """Log one warning, naming both keys, per `--set training.X=...` in `overrides` (raw `KEY=VALUE` strings) that
    a stage section of the pipeline config `cfg` shadows (sets X)."""
    stage_fields = {f.name for f in dataclasses.fields(StageConfig)}
    for item in overrides or ():
        key = item.partition("=")[0].strip()
        section, _, name = key.partition(".")
        if section != "training" or name not in stage_fields:
            continue
        for stage in STAGES:
            value = getattr(getattr(cfg, f"{stage}_training"), name)
            if value is not None:
                log.warning("--set %s does not change the %s stage: %s_training.%s = %s shadows it; set %s_training.%s "
                            "instead (or set it to null to inherit)", key, stage, stage, name, value, stage, name)


@dataclass
class SamplingConfig:
    """Sampling of the forecast paths (`forecast:` in YAML)."""

    temperature: float = 1.0
    """Sampling temperature (the original Qlib backtest used 0.6)."""
    top_k: int = 0
    """Keep the k most likely tokens when sampling (0 = off; 1 = greedy and deterministic)."""
    top_p: float = 0.9
    """Nucleus sampling threshold (1.0 = off)."""
    sample_count: int = 20
    """Sample paths per forecast: their mean is the point forecast, their spread the quantiles / CRPS / coverage
    (a single path is noise; the issue-12 audit saw the headline score move 17% across seeds with 1)."""
    seed: int = 0
    """Seed of the sampling, so a forecast can be reproduced."""

    def check(self, problems: Problems, prefix: str = "forecast") -> None:
        """Add every problem of these settings to `problems`, named `prefix.key`."""
        problems.check(self.temperature > 0, f"{prefix}.temperature", f"must be > 0, got {self.temperature}")
        problems.check(self.top_k >= 0, f"{prefix}.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        problems.check(0 < self.top_p <= 1, f"{prefix}.top_p", f"must be in (0, 1], got {self.top_p}")
        problems.check(self.sample_count >= 1, f"{prefix}.sample_count", f"must be >= 1, got {self.sample_count}")


def tracker_problems(*, tensorboard: bool = False, mlflow: bool = False, comet: bool = False,
                     prefix: str = "training") -> list[tuple[str, str]]:
    """(yaml key, message) for every enabled tracker whose package is missing; [] when all can be used.

    Lets config validation report a missing package before any data is loaded or model built."""
    out = []
    for name, enabled, package in (("tensorboard", tensorboard, "tensorboard"), ("mlflow", mlflow, "mlflow"),
                                   ("comet", comet, "comet_ml")):  # package = the module to import
        if enabled and importlib.util.find_spec(package) is None:
            out.append((f"{prefix}.{name}" if prefix else name,
                        f"is true but {package} is not installed: `pip install {package}` or set it to false"))
    return out


@dataclass
class ModelConfig:
    """Starting points of the two models (`model:` in YAML, the same in both pipelines)."""

    pretrained_tokenizer: str | None = "NeoQuasar/Kronos-Tokenizer-base"
    """Tokenizer to finetune: a save_pretrained folder or a Hugging Face Hub id; null = from scratch
    (tokenizer_arch)."""
    pretrained_predictor: str | None = "NeoQuasar/Kronos-small"
    """Predictor to finetune: a save_pretrained folder or a Hub id; null = from scratch (predictor_arch)."""
    tokenizer_arch: KronosTokenizerConfig = field(default_factory=KronosTokenizerConfig)
    """KronosTokenizer constructor arguments when pretrained_tokenizer is null (ignored otherwise)."""
    predictor_arch: KronosConfig = field(default_factory=KronosConfig)
    """Kronos constructor arguments when pretrained_predictor is null (s1/s2 bits null = the tokenizer's)."""
    pretraining_cutoff: Any = None
    """Last date the published weights were trained on (a date, e.g. 2024-06-30); walk-forward test blocks that start
    before it are flagged and left out of the verdict. null = unknown (nothing is excluded)."""

    def check(self, problems: Problems, prefix: str = "model") -> None:
        """Add every problem of these settings to `problems`, named `prefix.key` (no file or Hub access)."""
        if self.pretraining_cutoff is not None:
            parse_date(self.pretraining_cutoff, f"{prefix}.pretraining_cutoff", problems, "use e.g. 2024-06-30 or null")
        for name in ("pretrained_tokenizer", "pretrained_predictor"):
            value = getattr(self, name)
            problems.check(value is None or bool(str(value).strip()), f"{prefix}.{name}",
                           "is empty; give a folder or hub id, or null to train from scratch")
        tok, pred = self.tokenizer_arch, self.predictor_arch
        if self.pretrained_tokenizer is None:
            for key, message in tok.problems(f"{prefix}.tokenizer_arch"):
                problems.add(key, message)
            problems.check(tok.d_in == len(FEATURES), f"{prefix}.tokenizer_arch.d_in",
                           f"must be {len(FEATURES)} (the features {FEATURES}), got {tok.d_in}")
        if self.pretrained_predictor is None:
            for key, message in pred.problems(f"{prefix}.predictor_arch"):
                problems.add(key, message)
            if self.pretrained_tokenizer is None:  # both from scratch: the bits can be compared now
                for bits in ("s1_bits", "s2_bits"):
                    want, got = getattr(tok, bits), getattr(pred, bits)
                    problems.check(got is None or got == want, f"{prefix}.predictor_arch.{bits}",
                                   f"is {got} but {prefix}.tokenizer_arch.{bits} is {want}; set it to null "
                                   "(= the tokenizer's) or to the same value")
