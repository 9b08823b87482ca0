"""Finetune Kronos on your own CSV candles: the tokenizer first, then the predictor on the finetuned tokenizer's tokens.

`run_finetune(cfg, ...)` is the whole run as a function (the CSV data side, `CsvPipeline`, handed to the engine's
stage runner); one GPU/CPU or torchrun. Outputs and the prepared store: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping

import pandas as pd

import finetune_csv.config as csv_config
from finetune.utils.cli_args import add_config_args, add_run_flags, parse_config_args, run_overrides
from finetune.utils.errors import setup_logging
from finetune.utils.schema import STAGES
from finetune.utils.stages import plan_stages, run_stages, stage_resume
from finetune.utils.training_utils import TrainResult
from finetune.utils.windows import PanelSegments
from finetune_csv.config import CsvFinetuneConfig
from finetune_csv.pipeline import CsvPipeline
from finetune_csv.sources import list_sources

log = logging.getLogger("finetune_csv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_flags(add_config_args(parser, CsvFinetuneConfig, csv_config.load))
    parser.add_argument("--skip-tokenizer", action="store_true",
                        help="do not train the tokenizer (the predictor uses the finetuned or pretrained one)")
    parser.add_argument("--skip-basemodel", "--skip-predictor", dest="skip_predictor", action="store_true",
                        help="do not train the predictor (basemodel)")
    parser.add_argument("--skip-existing", action="store_true",
                        help="skip a stage that FINISHED before (an interrupted stage is resumed, not skipped; "
                             "finished stages are also skipped by default, unless --overwrite)")
    return parse_config_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()  # rank 0 reports; under torchrun the other ranks only warn
    cfg = csv_config.load(args.config, list(args.set) + run_overrides(args))
    run_finetune(cfg, skip_tokenizer=args.skip_tokenizer, skip_predictor=args.skip_predictor,
                 skip_existing=args.skip_existing)
    return 0


def run_finetune(cfg: CsvFinetuneConfig, *, skip_tokenizer: bool = False, skip_predictor: bool = False,
                 skip_existing: bool = False, frames: Mapping[str, pd.DataFrame] | None = None,
                 splits: dict[str, PanelSegments] | None = None
                 ) -> tuple[list[TrainResult], dict[str, str | None], dict]:
    """The CSV finetuning run for a validated config: data store, tokenizer stage, predictor stage, calibration.

    frames: {name: DataFrame} (finetune_csv/api.py), read instead of the files of data.path.
    splits: explicit {"train", "val"} index ranges of the store's panel (a walk-forward fold) instead of the ratios.
    Returns (results of the stages that trained, {stage: None | why skipped}, the data summary of run_info.json)."""
    pipe = CsvPipeline(cfg, frames, splits)
    skip = {"tokenizer": "--skip-tokenizer"} if skip_tokenizer else {}
    if skip_predictor:
        skip["predictor"] = "--skip-basemodel"
    pipe.plan = plan_stages(pipe, STAGES, skip, skip_existing)
    list_sources(cfg.data.path if frames is None else frames)  # a wrong data path, before any model loads
    results, data_info = run_stages(pipe, pipe.plan, stage_resume(pipe, pipe.plan), rebuild_changed=skip_existing)
    return results, pipe.plan, data_info


if __name__ == "__main__":
    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
