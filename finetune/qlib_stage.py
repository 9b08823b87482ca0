"""What the two Qlib trainer scripts share: the command line, the checks, torchrun, and the Qlib data side of the
engine's stage runner (finetune/utils/stages.py).

Each script (finetune/train_tokenizer.py, finetune/train_predictor.py) only says which stage it trains and which
model folders it reads (`StageSpec`) and calls `run_stage`; settings and input checks run before the process group
starts, then the stage runner trains that one stage. The trainers require torchrun, as the original's do."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from finetune.config import QlibConfig, check_model_folder, cli_parser, load
from finetune.dataset import build_train_val_datasets, check_processed
from finetune.utils.cli_args import add_run_flags, parse_config_args, run_overrides
from finetune.utils.config_utils import get_dotted
from finetune.utils.distributed import DistInfo, require_torchrun
from finetune.utils.errors import setup_logging
from finetune.utils.stages import plan_stages, run_stages

TOKENIZER_KEY = "paths.finetuned_tokenizer_path"


@dataclass(frozen=True)
class StageSpec:
    """One Qlib training stage: its name, script, and the model folders it reads."""

    stage: Literal["tokenizer", "predictor"]  # Engine stage; also the per-stage config section `<stage>_training`.
    script: str  # The script path, for the torchrun hint.
    # (dotted config key of a model folder/hub id the stage reads, whether a Hub id is allowed).
    model_folders: tuple[tuple[str, bool], ...]


class QlibPipeline:
    """The Qlib pipeline's side of the stage runner: the processed splits, the finetuned tokenizer the predictor
    trains with, and selection by validation RankIC (`training.select_by: ic`); no calibration."""

    def __init__(self, cfg: QlibConfig):
        self.cfg = cfg
        self.val_set = None

    def stage_dir(self, stage: str) -> Path:
        return Path(getattr(self.cfg.paths, f"{stage}_dir"))

    def output_key(self, stage: str) -> str:
        return f"paths.{stage}_dir"

    def datasets(self, dist: DistInfo) -> tuple:
        train_set, self.val_set, data_info = build_train_val_datasets(self.cfg)
        return train_set, self.val_set, data_info

    def tokenizer_source(self) -> tuple[str, str]:
        return self.cfg.paths.finetuned_tokenizer_path, TOKENIZER_KEY

    def val_metric(self, select_by: str, tokenizer):
        if select_by != "ic":
            return None
        from finetune.qlib_forecast import make_ic_val_metric  # choose the checkpoint by validation RankIC

        return make_ic_val_metric(self.cfg, self.val_set.panel, tokenizer)

    def calibrate(self, best: Path) -> None:  # the Qlib forecast reports no bands to calibrate
        return None


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
    parser = add_run_flags(cli_parser(doc or spec.script))
    parser.add_argument("--skip-existing", action="store_true",
                        help="reuse a finished stage while it is current, else train it again (the walk-forward's "
                             "periods); without it a finished stage that is not current is refused by name")
    args = parse_config_args(parser, argv)
    require_torchrun(spec.script, args=f"--config {args.config}")
    cfg = load(args.config, list(args.set) + run_overrides(args))
    check_inputs(spec, cfg)
    pipe = QlibPipeline(cfg)
    run_stages(pipe, plan_stages(pipe, (spec.stage,), {}, args.skip_existing), rebuild_changed=args.skip_existing)
