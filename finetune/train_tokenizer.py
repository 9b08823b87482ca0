"""Finetune the Kronos tokenizer on the preprocessed Qlib splits (stage 1 of 2).

    torchrun --standalone --nproc_per_node=N finetune/train_tokenizer.py --config configs/qlib_csi300.yaml
    DIST_BACKEND=gloo torchrun --standalone --nproc_per_node=2 finetune/train_tokenizer.py \
        --config configs/qlib_demo.yaml

Writes paths.tokenizer_dir: best_model/ (the finetuned tokenizer, config.json + model.safetensors),
checkpoints/last.pt (resumed automatically on a rerun), metrics.jsonl, loss_curve.png, run_info.json.
"""

from __future__ import annotations

import argparse
import logging

from finetune.config import QlibConfig, check_model_folder, cli_parser, load
from finetune.dataset import build_train_val_datasets, check_processed
from finetune.utils.config_utils import config_to_dict
from finetune.utils.distributed import distributed_context, require_torchrun
from finetune.utils.factory import build_tokenizer
from finetune.utils.logging_setup import setup_logging
from finetune.utils.seeding import seeded_init
from finetune.utils.training_utils import train_tokenizer

log = logging.getLogger(__name__)
SCRIPT = "finetune/train_tokenizer.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli_parser(__doc__)
    return parser.parse_args(argv)


def check_inputs(cfg: QlibConfig) -> None:
    """Every settings and input-file problem of this stage, raised as one ConfigError before anything starts."""
    problems = cfg.problems()
    check_processed(cfg, ("train", "val"), problems)
    check_model_folder(cfg.model.pretrained_tokenizer, "model.pretrained_tokenizer", problems, hub_ok=True)
    problems.raise_if_any()


def main(argv: list[str] | None = None) -> None:
    setup_logging()  # rank 0 reports; the other ranks only warn (torchrun sets RANK before the process starts)
    args = parse_args(argv)
    require_torchrun(SCRIPT, f"--config {args.config}")
    cfg = load(args.config, args.set)
    check_inputs(cfg)
    training = cfg.stage_training("tokenizer")

    with distributed_context(training.dist_timeout_s) as dist:
        train_set, val_set, data_info = build_train_val_datasets(cfg)
        with seeded_init(training.seed):  # a from-scratch tokenizer starts from the same weights on every run
            tokenizer = build_tokenizer(cfg.model.pretrained_tokenizer, cfg.model.tokenizer_arch, "model")
        result = train_tokenizer(
            tokenizer, train_set, val_set, training, cfg.paths.tokenizer_dir, dist,
            run_config=config_to_dict(cfg), data_info=data_info,
        )
        if dist.is_main:
            log.info(f"[tokenizer] best val loss {result.best_val_loss:.4f} (epoch {result.best_epoch}); "
                  f"finetuned tokenizer: {result.best_model_dir}")


if __name__ == "__main__":
    import sys

    from finetune.cli import run_script  # clean errors, exit codes, --debug, --help-config, --print-config

    sys.exit(run_script("qlib-train-tokenizer", main))
