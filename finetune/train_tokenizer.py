"""Finetune the Kronos tokenizer on the preprocessed Qlib splits (stage 1 of 2).

    torchrun --standalone --nproc_per_node=N finetune/train_tokenizer.py --config configs/qlib_csi300.yaml
    DIST_BACKEND=gloo torchrun --standalone --nproc_per_node=2 finetune/train_tokenizer.py \
        --config configs/qlib_demo.yaml [--resume | --overwrite] [--set training.epochs=3 ...]

Writes paths.tokenizer_dir: best_model/ (the finetuned tokenizer, config.json + model.safetensors),
checkpoints/ (rotating step-*.pt, last.pt = the newest), metrics.jsonl, train.log, loss_curve.png, run_info.json.
A re-run resumes an unfinished stage and skips a finished one (see finetune/dataset.py)."""

from __future__ import annotations

from finetune.dataset import StageSpec, run_stage

SPEC = StageSpec("tokenizer", "finetune/train_tokenizer.py", (("model.pretrained_tokenizer", True),))


def main(argv: list[str] | None = None) -> None:
    run_stage(SPEC, argv, __doc__)


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # one error line and an exit code (finetune/utils/errors.py)

    sys.exit(run_main(main))
