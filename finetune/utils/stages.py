"""The stage runner both pipelines call (`plan_stages`, `stage_resume`, `run_stages`): tokenizer stage, predictor
stage on the tokenizer it produced, calibration of the predictor's bands; a pipeline writes its data side only (a
`Pipeline`). What it guarantees (model checks, seeding, safe points on a stop): docs/architecture.md, "Formats and
designs"."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from torch import nn
from torch.utils.data import Dataset

import model.predictor as forecaster
from finetune.utils import adapters
from finetune.utils.config_utils import Problems, config_to_dict
from finetune.utils.distributed import DistInfo, distributed_context, seeded_init
from finetune.utils.ledger import stage_status
from finetune.utils.safety import GracefulStop, raise_if_stop_requested
from finetune.utils.schema import STAGES, PipelineConfig
from finetune.utils.training_utils import TrainResult, train_predictor, train_tokenizer
from finetune.utils.validate import ValMetric
from model import Kronos, KronosTokenizer
from model.calibration import decoding_changes
from model.config import KronosConfig, KronosTokenizerConfig
from model.hub import load_pretrained, weights_fingerprint

log = logging.getLogger(__name__)
NOT_IN_RUN = "not this run's stage"
SKIP_EXISTING = "--skip-existing"  # a plan entry starting so: the finished stage is reused while current


class Pipeline(Protocol):
    """A pipeline's data side: all the stage runner asks of it. `cfg`: its settings, of which the engine reads the
    shared sections (`PipelineConfig`: data.window, model, training and the stage sections)."""

    cfg: PipelineConfig

    def stage_dir(self, stage: str) -> Path: ...  # the stage's output folder

    def output_key(self, stage: str) -> str: ...  # the setting naming it (a full disk names it)

    def datasets(self, dist: DistInfo) -> tuple[Dataset, Dataset, dict[str, Any]]: ...  # train, val, data_info

    def tokenizer_source(self) -> tuple[str, str]: ...  # (folder / Hub id, its setting): the predictor's tokenizer

    def val_metric(self, select_by: str, tokenizer: nn.Module) -> ValMetric | None: ...  # None for 'loss'

    def calibrate(self, best: Path) -> dict | None: ...  # fit the bands of the predictor in best; None: none


def run_stages(pipe: Pipeline, plan: Mapping[str, str | None], resume: Mapping[str, str] | None = None,
               rebuild_changed: bool = False) -> tuple[list[TrainResult], dict[str, Any]]:
    """Train the stages `plan` leaves in (None), in order, then calibrate the predictor; returns (the results of
    the stages that ran, the data_info). Raises TrainingStopped (exit 75) at the first safe point after a stop
    signal, and every settings or model error before `pipe.datasets` writes anything."""
    cfg, m, d = pipe.cfg, pipe.cfg.model, pipe.cfg.data
    resume = resume or {}
    # --skip-existing (`rebuild_changed`): a stage is reused or resumed while current, else trained again.
    plan = {s: None if (why or "").startswith(SKIP_EXISTING) else why for s, why in plan.items()}
    training = {s: dataclasses.replace(cfg.stage_training(s), **({"resume": resume[s]} if s in resume else {}))
                for s in STAGES}
    # The tokenizer has no forecast to score: it is always selected by its validation loss.
    training["tokenizer"] = dataclasses.replace(training["tokenizer"], select_by="loss")
    results: list[TrainResult] = []
    with GracefulStop(), distributed_context(cfg.training.dist_timeout_s) as dist:
        # Models first (cheap to check, and a mistake then leaves no data behind): the pair, and what the finetune
        # mode trains of this predictor.
        tokenizer = predictor = None
        if plan["tokenizer"] is None:
            with seeded_init(training["tokenizer"].seed):
                tokenizer = build_tokenizer(m.pretrained_tokenizer, m.tokenizer_arch, "model")
        if plan["predictor"] is None:
            trained_tokenizer = tokenizer is not None
            tokenizer, predictor = _predictor_pair(pipe, training["predictor"].seed, tokenizer)
            adapters.MODES[training["predictor"].finetune_mode].check(predictor, training["predictor"])
        train_set, val_set, data_info = pipe.datasets(dist)
        raise_if_stop_requested("before training", dist)
        common = dict(run_config=config_to_dict(cfg), data_info=data_info, window=d.window)
        if plan["tokenizer"] is None:
            results.append(train_tokenizer(tokenizer, train_set, val_set, training["tokenizer"],
                                           pipe.stage_dir("tokenizer"), dist, output_key=pipe.output_key("tokenizer"),
                                           rebuild_changed=rebuild_changed, **common))
            raise_if_stop_requested("after the tokenizer stage", dist)
        if plan["predictor"] is None:
            if trained_tokenizer:  # the best tokenizer epoch on disk (not the last one in memory)
                tokenizer, predictor = _predictor_pair(pipe, training["predictor"].seed)
            # What forecasting needs beside the weights (kronos_predictor.json): the window and the clip; the
            # tokenizer is copied inside best_model/, its weights' sha256 pins the pair.
            forecast_info = {**d.window.info(), "tokenizer_sha256": weights_fingerprint(tokenizer)}
            results.append(train_predictor(predictor, tokenizer, train_set, val_set, training["predictor"],
                                           pipe.stage_dir("predictor"), dist, forecast_info=forecast_info,
                                           val_metric=pipe.val_metric(training["predictor"].select_by, tokenizer),
                                           output_key=pipe.output_key("predictor"),
                                           rebuild_changed=rebuild_changed, **common))
            raise_if_stop_requested("after the predictor stage", dist)
        if dist.is_main:
            # Calibrate the finished predictor's bands when this run trained it or its kronos_predictor.json lacks a
            # calibration (a run stopped between the two) or holds one of other sampling (forecast.sample_count...).
            trained = any(r.stage == "predictor" and not r.skipped for r in results)
            folder = pipe.stage_dir("predictor")
            cal = forecaster.read_predictor_info(folder / "best_model").get("calibration")
            if stage_status(folder) == "finished" and (trained or cal is None or decoding_changes(
                    cal, cfg.forecast.decoding())):  # fitted with other sampling: refit (no retraining)
                pipe.calibrate(folder / "best_model")
            done = [f"  {r.stage}: best val loss {r.best_val_loss:.4f} (epoch {r.best_epoch}), {r.global_step} steps "
                    f"-> {r.best_model_dir}" for r in results]
            skipped = [f"  {s}: skipped ({why})" for s, why in plan.items() if why not in (None, NOT_IN_RUN)]
            log.info("%s", "\n".join(["done.", *done, *skipped]))
    return results, data_info


def plan_stages(pipe: Pipeline, stages: Sequence[str], skip: Mapping[str, str], skip_existing: bool
                ) -> dict[str, str | None]:
    """For each of STAGES, None if it trains, else why not: not in `stages`, `skip[stage]` (the flag that skipped
    it), 0 epochs, a finetune mode that keeps the tokenizer frozen (when the predictor follows it in this run),
    --skip-existing on a finished stage (`SKIP_EXISTING`: reused by the ledger while current, else retrained)."""
    plan: dict[str, str | None] = {}
    mode = pipe.cfg.training.finetune_mode
    for stage in STAGES:
        if stage not in stages:
            plan[stage] = NOT_IN_RUN
        elif stage in skip:
            plan[stage] = skip[stage]
        elif pipe.cfg.stage_training(stage).epochs == 0:
            plan[stage] = f"{stage}_training.epochs is 0"
        elif stage == "tokenizer" and "predictor" in stages and not adapters.MODES[mode].trains_tokenizer:
            plan[stage] = f"training.finetune_mode is {mode} (the tokenizer stays frozen)"
        elif skip_existing and stage_status(pipe.stage_dir(stage)) == "finished":
            plan[stage] = f"{SKIP_EXISTING} and {pipe.stage_dir(stage)} holds a finished run"
        else:
            plan[stage] = None
    return plan


def stage_resume(pipe: Pipeline, plan: Mapping[str, str | None]) -> dict[str, str]:
    """Each stage's training.resume. --resume (required) insists on resuming the RUN: when some stage that trains
    has a run in its folder, a stage with an empty folder starts fresh (e.g. the predictor after a kill in the
    tokenizer stage) instead of failing; with nothing anywhere to resume, it stays an error."""
    status = {stage: stage_status(pipe.stage_dir(stage)) for stage in STAGES if plan[stage] is None}
    resume = {stage: pipe.cfg.stage_training(stage).resume for stage in STAGES}
    if any(s != "empty" for s in status.values()):
        for stage, s in status.items():
            if s == "empty" and resume[stage].strip().lower() == "required":
                resume[stage] = "auto"
    return resume


def _predictor_pair(pipe: Pipeline, seed: int, tokenizer: KronosTokenizer | None = None) -> tuple[Any, Any]:
    """(tokenizer, predictor to finetune): `tokenizer` (the one the tokenizer stage is about to train: the pair is
    checked before that stage's hour of training), else the pipeline's tokenizer source."""
    key = None
    if tokenizer is None:
        source, key = pipe.tokenizer_source()
        tokenizer = load_pretrained(KronosTokenizer, source, key)
    m = pipe.cfg.model
    with seeded_init(seed):
        predictor = build_predictor(m.pretrained_predictor, m.predictor_arch, tokenizer, "model", tokenizer_key=key)
    return tokenizer, predictor


def build_tokenizer(pretrained: str | None, arch: KronosTokenizerConfig, key: str = "model") -> KronosTokenizer:
    """The tokenizer to finetune: `pretrained` loaded (folder or hub id), or with None a fresh one built from `arch`;
    errors name `{key}.pretrained_tokenizer` / `{key}.tokenizer_arch`."""
    if pretrained is not None:
        return load_pretrained(KronosTokenizer, pretrained, f"{key}.pretrained_tokenizer")
    problems = Problems(f"Invalid {key}.tokenizer_arch")
    for k, message in arch.problems(f"{key}.tokenizer_arch"):
        problems.add(k, message)
    problems.raise_if_any()
    return KronosTokenizer(**dataclasses.asdict(arch))


def build_predictor(pretrained: str | None, arch: KronosConfig, tokenizer: KronosTokenizer, key: str = "model",
                    *, tokenizer_key: str | None = None) -> Kronos:
    """The predictor to finetune, reading the tokens of `tokenizer`: `pretrained` loaded, or with None a fresh one
    built from `arch` (its s1_bits / s2_bits None = the tokenizer's). Its vocabularies (2^s1_bits, 2^s2_bits) match
    the tokenizer's; a mismatch is a ValueError naming the keys that chose the pair (`tokenizer_key`: the setting
    the tokenizer came from, default `{key}.pretrained_tokenizer / {key}.tokenizer_arch`)."""
    tokenizer_key = tokenizer_key or f"{key}.pretrained_tokenizer / {key}.tokenizer_arch"
    if pretrained is not None:
        predictor = load_pretrained(Kronos, pretrained, f"{key}.pretrained_predictor")
        predictor.check_tokenizer(tokenizer, f"{tokenizer_key} / {key}.pretrained_predictor")
        return predictor
    problems = Problems(f"Invalid {key}.predictor_arch")
    for k, message in arch.problems(f"{key}.predictor_arch"):
        problems.add(k, message)
    args = dataclasses.asdict(arch)
    for bits in ("s1_bits", "s2_bits"):
        have = getattr(tokenizer, bits)
        if args[bits] is None:
            args[bits] = have
        problems.check(args[bits] == have, f"{key}.predictor_arch.{bits}",
                       f"is {args[bits]} but the tokenizer ({tokenizer_key}) has {bits} = {have}; set it to null "
                       "(= the tokenizer's) or to the same value")
    problems.raise_if_any()
    return Kronos(**args)
