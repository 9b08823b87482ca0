"""What the two Qlib trainer scripts share: the command line, the checks, torchrun, and one training stage.

    finetune/train_tokenizer.py  -> run_stage(TOKENIZER, argv)
    finetune/train_predictor.py  -> run_stage(PREDICTOR, argv)

Each script only says how its model is built (`StageSpec.build`); everything else - settings, input checks before
the process group starts, from-scratch initialisation that does not depend on the rank, the engine call, the one
summary line - is here, so the two stages cannot drift apart. The trainers require torchrun, as the original's do.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from finetune.config import QlibConfig, check_model_folder, cli_parser, load
from finetune.dataset import build_train_val_datasets, check_processed
from finetune.utils.cli_args import add_run_flags, parse_config_args, run_overrides
from finetune.utils.config_utils import config_to_dict, get_dotted
from finetune.utils.distributed import distributed_context, require_torchrun, seeded_init
from finetune.utils.errors import setup_logging
from finetune.utils.training_utils import train_predictor, train_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageSpec:
    """One Qlib training stage: its name, script, the model folders it reads, and how its models are built."""

    stage: Literal["tokenizer", "predictor"]  # Engine stage; also the per-stage config section `<stage>_training`.
    script: str  # The script path, for the torchrun hint.
    # (dotted config key of a model folder/hub id the stage reads, whether a Hub id is allowed).
    model_folders: tuple[tuple[str, bool], ...]
    # cfg -> keyword arguments of the engine call: the models (tokenizer=..., predictor=...).
    build: Callable[[QlibConfig], dict[str, Any]]


def check_inputs(spec: StageSpec, cfg: QlibConfig) -> None:
    """Every settings and input-file problem of the stage, raised as one ConfigError before anything starts."""
    problems = cfg.problems()
    check_processed(cfg, ("train", "val"), problems)
    for key, hub_ok in spec.model_folders:
        check_model_folder(get_dotted(cfg, key), key, problems, hub_ok=hub_ok)
    problems.raise_if_any()


def run_stage(spec: StageSpec, argv: list[str] | None = None, doc: str = "") -> None:
    """Parse, check every input before the process group starts, then train `spec.stage` under torchrun."""
    setup_logging()  # rank 0 reports; the other ranks only warn (torchrun sets RANK before the process starts)
    args = parse_config_args(add_run_flags(cli_parser(doc or spec.script)), argv)
    require_torchrun(spec.script, args=f"--config {args.config}")
    cfg = load(args.config, list(args.set) + run_overrides(args))
    check_inputs(spec, cfg)
    training = cfg.stage_training(spec.stage)
    if spec.stage == "tokenizer":  # the tokenizer has no forecast to score: it is always selected by its loss
        training = dataclasses.replace(training, select_by="loss")
    out_dir = cfg.paths.tokenizer_dir if spec.stage == "tokenizer" else cfg.paths.predictor_dir

    with distributed_context(training.dist_timeout_s) as dist:
        train_set, val_set, data_info = build_train_val_datasets(cfg)
        with seeded_init(training.seed):  # a from-scratch model starts from the same weights on every run
            models = spec.build(cfg)
        common = dict(run_config=config_to_dict(cfg), data_info=data_info, output_key=f"paths.{spec.stage}_dir")
        if spec.stage == "tokenizer":
            result = train_tokenizer(models["tokenizer"], train_set, val_set, training, out_dir, dist, **common)
        else:
            val_metric = None
            if training.select_by == "ic":  # choose the checkpoint by validation RankIC instead of token loss
                from finetune.qlib_forecast import make_ic_val_metric

                val_metric = make_ic_val_metric(cfg, val_set.panel, models["tokenizer"])
            # What forecasting needs beside the weights: the training window, the tokenizer and the clip.
            forecast_info = {"max_context": cfg.data.lookback + cfg.data.predict, "lookback": cfg.data.lookback,
                             "tokenizer": cfg.paths.finetuned_tokenizer_path, "clip": cfg.data.clip}
            result = train_predictor(models["predictor"], models["tokenizer"], train_set, val_set, training, out_dir,
                                     dist, val_metric=val_metric, forecast_info=forecast_info, **common)
        if dist.is_main:
            log.info("[%s] best val loss %.4f (epoch %s); model: %s", spec.stage, result.best_val_loss,
                     result.best_epoch, result.best_model_dir)
