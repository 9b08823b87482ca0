"""Finetune the Kronos predictor on tokens of the finetuned tokenizer (stage 2 of 2; run train_tokenizer.py first).

    torchrun --standalone --nproc_per_node=N finetune/train_predictor.py --config configs/qlib_csi300.yaml
    DIST_BACKEND=gloo torchrun --standalone --nproc_per_node=2 finetune/train_predictor.py \
        --config configs/qlib_demo.yaml [--resume | --overwrite] [--set training.select_by=ic ...]

The tokenizer comes from paths.finetuned_tokenizer_path and stays frozen. Writes paths.predictor_dir: best_model/
(the finetuned predictor plus tokenizer_config.json), checkpoints/, metrics.jsonl, train.log, loss_curve.png,
run_info.json. `training.select_by: ic` keeps the epoch with the best validation RankIC instead of the lowest loss."""

from __future__ import annotations

from finetune.dataset import TOKENIZER_KEY, StageSpec, run_stage

SPEC = StageSpec("predictor", "finetune/train_predictor.py",
                 ((TOKENIZER_KEY, False), ("model.pretrained_predictor", True)))


def main(argv: list[str] | None = None) -> None:
    run_stage(SPEC, argv, __doc__)


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
