"""The translation of a YAML file written for the ORIGINAL Kronos `finetune_csv` (shiyu-coder/Kronos) into this
project's settings (finetune_csv/config.py `load` calls `translate_original`).

`RULES` says how each original key carries over (renamed, converted, not needed, or unsupported with what to do
instead); `translate` is pure; `translate_original` also logs the mapping once and refuses original keys mixed into
this project's format. A `pre_trained: false` reads the original model folder's config.json for its architecture."""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.utils.config_utils import get_dotted, parse_overrides, set_dotted
from model.config import KronosConfig, KronosTokenizerConfig
from model.errors import ConfigError

log = logging.getLogger(__name__)

# Top-level sections only the original has / only ours has.
ORIGINAL_ONLY_SECTIONS = ("model_paths", "experiment", "device", "distributed")
NEW_ONLY_SECTIONS = ("model", "paths", "tokenizer_training", "predictor_training", "forecast")

Outcome = list[tuple[str, Any]]  # (new dotted key, value) pairs to set
_MISSING = object()


@dataclass(frozen=True)
class Rule:
    """How one original key carries over."""

    new: str | None  # This project's dotted key receiving the value; None = not carried over (see same_as_ours / note).
    note: str = ""  # Shown in the log line: why the key is not needed, or how to get its effect here.
    # (value, whole original config) -> [(new key, new value), ...] for keys that do not map one to one.
    convert: Callable[[Any, Mapping[str, Any]], Outcome] | None = None
    # For keys with no counterpart: True when the value asks for what this pipeline does anyway (dropped quietly);
    # any other value is reported as unsupported. None with `new` None: always dropped with the note.
    same_as_ours: Callable[[Any], bool] | None = None


def _betas(value: Any, raw: Mapping[str, Any]) -> Outcome:
    # The original has two scalars; ours is one [beta1, beta2] list (original defaults 0.9 / 0.95).
    return [("training.betas", [get_dotted(raw, "training.adam_beta1", 0.9),
                                get_dotted(raw, "training.adam_beta2", 0.95)])]


def _base_path(value: Any, raw: Mapping[str, Any]) -> Outcome:
    if get_dotted(raw, "model_paths.base_save_path"):  # an explicit base_save_path wins in the original too
        return []
    return [("paths.base_dir", f"{str(value).rstrip('/')}/{{exp_name}}")]


def _stage_switch(stage: str) -> Callable[[Any, Mapping[str, Any]], Outcome]:
    return lambda value, raw: [] if value else [(f"{stage}_training.epochs", 0)]  # 0 epochs = the stage is skipped


def _from_scratch(kind: str) -> Callable[[Any, Mapping[str, Any]], Outcome]:
    """experiment.pre_trained[_<kind>]: false = a randomly initialised model with the pretrained one's architecture.

    `kind` 'tokenizer' / 'predictor' handles `pre_trained_<kind>`; 'both' handles the shared `pre_trained`, which
    the original lets `pre_trained_<kind>` override."""

    def one(which: str, value: Any, raw: Mapping[str, Any]) -> Outcome:
        if value is not False:
            return []
        source = get_dotted(raw, f"model_paths.pretrained_{which}")
        cfg_file = Path(str(source)).expanduser() / "config.json" if source else None
        if cfg_file is None or not cfg_file.is_file():
            raise _Unsupported(f"the original copies the {which} architecture from {source}/config.json, which is "
                               f"not a local file here; set model.pretrained_{which}: null and model.{which}_arch")
        arch_fields = (KronosTokenizerConfig if which == "tokenizer" else KronosConfig).__dataclass_fields__
        arch = json.loads(cfg_file.read_text(encoding="utf-8"))
        return [(f"model.pretrained_{which}", None)] + [
            (f"model.{which}_arch.{k}", v) for k, v in arch.items() if k in arch_fields]

    def convert(value: Any, raw: Mapping[str, Any]) -> Outcome:
        if kind != "both":
            return one(kind, value, raw)
        return [pair for which in ("tokenizer", "predictor")
                if get_dotted(raw, f"experiment.pre_trained_{which}") is None
                for pair in one(which, value, raw)]

    return convert


def _finetuned_tokenizer(value: Any, raw: Mapping[str, Any]) -> Outcome:
    if not value:
        return []
    exp = get_dotted(raw, "model_paths.exp_name", "")
    base = (get_dotted(raw, "model_paths.base_save_path")
            or f"{str(get_dotted(raw, 'model_paths.base_path', '')).rstrip('/')}/{exp}")
    expected = f"{str(base).replace('{exp_name}', str(exp)).rstrip('/')}/tokenizer/best_model"
    if os.path.normpath(str(value).replace("{exp_name}", str(exp))) == os.path.normpath(expected):
        return []
    raise _Unsupported("the predictor stage always uses <paths.base_dir>/tokenizer/best_model once the tokenizer "
                       "stage has written it (else model.pretrained_tokenizer); point model.pretrained_tokenizer "
                       "at this folder and pass --skip-tokenizer to train on another tokenizer")


class _Unsupported(Exception):
    """Raised by a converter: the value cannot be honoured (message says what to do instead)."""


# Original key -> how it carries over. Keys are dotted paths in the original YAML.
RULES: dict[str, Rule] = {
    # data
    "data.data_path": Rule("data.path"),
    "data.lookback_window": Rule("data.lookback"),
    "data.predict_window": Rule("data.predict"),
    "data.max_context": Rule(None, "the forecast's context is data.lookback + data.predict; training needs no limit"),
    "data.clip": Rule("data.clip"),
    "data.train_ratio": Rule("data.train_ratio"),
    "data.val_ratio": Rule("data.val_ratio"),
    "data.test_ratio": Rule("data.test_ratio"),
    # training
    "training.epochs": Rule("training.epochs", "both stages, unless tokenizer_epochs / basemodel_epochs is given"),
    "training.tokenizer_epochs": Rule("tokenizer_training.epochs"),
    "training.basemodel_epochs": Rule("predictor_training.epochs"),
    "training.batch_size": Rule("training.batch_size"),
    "training.log_interval": Rule("training.log_every_steps", "counted in optimizer steps here"),
    "training.num_workers": Rule("training.num_workers"),
    "training.seed": Rule("training.seed"),
    "training.tokenizer_learning_rate": Rule("tokenizer_training.lr"),
    "training.predictor_learning_rate": Rule("predictor_training.lr"),
    "training.adam_beta1": Rule("training.betas", convert=_betas),
    "training.adam_beta2": Rule("training.betas", convert=_betas),
    "training.adam_weight_decay": Rule("training.weight_decay"),
    "training.accumulation_steps": Rule("training.accumulation_steps"),
    # model_paths
    "model_paths.pretrained_tokenizer": Rule("model.pretrained_tokenizer"),
    "model_paths.pretrained_predictor": Rule("model.pretrained_predictor"),
    "model_paths.exp_name": Rule("paths.exp_name"),
    "model_paths.base_path": Rule("paths.base_dir", "as <base_path>/{exp_name}", convert=_base_path),
    # An empty base_save_path = derived from base_path/exp_name (as here).
    "model_paths.base_save_path": Rule("paths.base_dir", convert=lambda v, raw: [("paths.base_dir", v)] if v else []),
    "model_paths.finetuned_tokenizer": Rule(None, "derived: <paths.base_dir>/tokenizer/best_model",
                                            convert=_finetuned_tokenizer),
    "model_paths.tokenizer_save_name": Rule(None, "the stage folders are fixed: tokenizer/ and basemodel/",
                                            same_as_ours=lambda v: v == "tokenizer"),
    "model_paths.basemodel_save_name": Rule(None, "the stage folders are fixed: tokenizer/ and basemodel/",
                                            same_as_ours=lambda v: v == "basemodel"),
    # experiment
    "experiment.name": Rule(None, "informational (paths.exp_name names the run)"),
    "experiment.description": Rule(None, "informational"),
    "experiment.use_comet": Rule("training.comet"),
    "experiment.train_tokenizer": Rule("tokenizer_training.epochs", "false = 0 epochs (stage skipped)",
                                       convert=_stage_switch("tokenizer")),
    "experiment.train_basemodel": Rule("predictor_training.epochs", "false = 0 epochs (stage skipped)",
                                       convert=_stage_switch("predictor")),
    "experiment.skip_existing": Rule(None, "pass --skip-existing on the command line",
                                     same_as_ours=lambda v: v is False),
    "experiment.pre_trained": Rule("model.pretrained_*", "false = from scratch", convert=_from_scratch("both")),
    "experiment.pre_trained_tokenizer": Rule("model.pretrained_tokenizer", "false = from scratch (tokenizer_arch)",
                                             convert=_from_scratch("tokenizer")),
    "experiment.pre_trained_predictor": Rule("model.pretrained_predictor", "false = from scratch (predictor_arch)",
                                             convert=_from_scratch("predictor")),
    # device / distributed: chosen by the launch here, not by the YAML
    "device.use_cuda": Rule(None, "CUDA is used when available; CUDA_VISIBLE_DEVICES= forces the CPU",
                            same_as_ours=lambda v: v is True),
    "device.device_id": Rule(None, "choose the GPU with CUDA_VISIBLE_DEVICES=<id>",
                             same_as_ours=lambda v: v in (0, None)),
    "distributed.use_ddp": Rule(None, "DDP runs when the command is launched by torchrun"),
    "distributed.backend": Rule(None, "set DIST_BACKEND=<backend> in the environment (default nccl on GPUs)",
                                same_as_ours=lambda v: str(v).lower() == "nccl"),
}

# The original's defaults where they differ from this pipeline's, applied when an original file leaves them out.
ORIGINAL_DEFAULTS: dict[str, Any] = {"training.batch_size": 160}


@dataclass
class Translation:
    """The result of `translate`: `values`, the nested settings in this project's format (what a YAML file in
    configs/ would hold); `lines`, one per original key (`old -> new = value`, or why it is not needed); and
    `unsupported`, one per original key whose value cannot be honoured, with what to do instead."""

    values: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)


def is_original_config(raw: Any) -> bool:
    """True for a mapping with the original's top-level sections (model_paths / experiment / device / distributed,
    or original-only keys under data / training) and none of this project's own sections."""
    if not isinstance(raw, Mapping) or any(s in raw for s in NEW_ONLY_SECTIONS):
        return False
    if any(s in raw for s in ORIGINAL_ONLY_SECTIONS):
        return True
    return any(key in RULES and RULES[key].new != key for key in _leaves(raw))


def _leaves(raw: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.extend(_leaves(v, key) if isinstance(v, Mapping) else [key])
    return out


def translate(raw: Mapping[str, Any]) -> Translation:
    """Map an original-format config (already read from YAML) to this project's keys; pure (logs nothing)."""
    out = Translation()
    order = [k for k in RULES if get_dotted(raw, k, _MISSING) is not _MISSING]
    unknown = [k for k in _leaves(raw) if k not in RULES]
    for key in order:
        rule, value = RULES[key], get_dotted(raw, key)
        shown = json.dumps(value) if isinstance(value, (str, bool)) or value is None else value
        try:
            if rule.convert is not None:
                pairs = rule.convert(value, raw)
            elif rule.new is not None:
                pairs = [(rule.new, value)]
            elif rule.same_as_ours is not None and not rule.same_as_ours(value):
                raise _Unsupported(rule.note)
            else:
                out.lines.append(f"{key} = {shown}: not needed; {rule.note}")
                continue
        except _Unsupported as why:
            out.unsupported.append(f"{key} = {shown}: not supported; {why}")
            continue
        for new_key, new_value in pairs:
            set_dotted(out.values, new_key, new_value)
        if pairs:
            targets = ", ".join(f"{k} = {json.dumps(v) if isinstance(v, (str, bool)) or v is None else v}"
                                for k, v in pairs)
            out.lines.append(f"{key} -> {targets}" + (f"  ({rule.note})" if rule.note else ""))
        else:
            out.lines.append(f"{key} = {shown}: not needed" + (f"; {rule.note}" if rule.note else ""))
    for key, value in ORIGINAL_DEFAULTS.items():
        old = next((k for k, r in RULES.items() if r.new == key), key)
        if get_dotted(raw, old, _MISSING) is _MISSING:
            set_dotted(out.values, key, value)
            out.lines.append(f"{old} (absent) -> {key} = {value}  (the original's default)")
    for key in unknown:
        out.unsupported.append(f"{key}: not a key of the original Kronos finetune_csv config; ignored")
    return out


def _split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(overrides of original keys, overrides of this project's keys)."""
    old, new = [], []
    for item in overrides or ():
        key = item.partition("=")[0].strip()
        (old if key in RULES and RULES[key].new != key else new).append(item)
    return old, new


def translate_original(raw: dict[str, Any], overrides: list[str], config_path: str | Path | None
                        ) -> tuple[dict[str, Any], list[str], bool]:
    """(settings in this project's format, overrides still to apply, was it an original-format file).

    An original-format mapping is translated (rank 0 logs each mapped key); original keys mixed into this
    project's format (in the file or in `--set`) are a ConfigError naming each key's new name."""
    old_overrides, new_overrides = _split_overrides(overrides)
    if not is_original_config(raw):
        keys = _leaves(raw) + [o.partition("=")[0].strip() for o in old_overrides]
        mixed = [f"{k}: a key of the original Kronos format; here it is "
                 f"{RULES[k].new or 'not needed (' + RULES[k].note + ')'}"
                 for k in keys if k in RULES and RULES[k].new != k]
        if mixed:
            raise ConfigError(mixed, f"Invalid configuration from {config_path} (original Kronos keys mixed "
                                     "into this project's format)")
        return raw, overrides, False
    raw = copy.deepcopy(raw)
    for key, value in parse_overrides(old_overrides):
        set_dotted(raw, key, value)
    result = translate(raw)
    if os.environ.get("RANK", "0") == "0":  # every rank translates; one reports
        log.warning("%s is in the original Kronos finetune_csv format; its keys map to this project's as follows:",
                    config_path)
        for line in result.lines + result.unsupported:
            log.warning("  %s", line)
    return result.values, new_overrides, True
