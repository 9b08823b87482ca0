"""Golden numbers of the training loop: a tiny deterministic run whose logged losses are pinned.

The equality tests (kill-and-resume, 2-rank DDP, accumulation) compare two runs of the same code, so a change that
moves both sides at once (the loss formula, micro-batch weighting, RNG seeding, schedule, data order) passes them.
These numbers were produced by the engine at commit b83892c (before the training loop was split into modules):
tiny tokenizer and predictor with dropout 0.1, sampled s1 (teacher_forcing=false), 2 micro-batches of 2 windows per
optimizer step, 4 steps per epoch, 2 epochs, CPU, one process, num_workers 0.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from finetune.utils.distributed import DistInfo
from finetune.utils.metrics import read_metrics
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import train_predictor, train_tokenizer
from tests.engine_dist_worker import tiny_datasets, tiny_predictor, tiny_tokenizer

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
CFG = TrainingConfig(epochs=2, batch_size=2, accumulation_steps=2, lr=1e-3, max_train_samples=16, num_workers=0,
                     log_every_steps=1, progress_bar=False, seed=7)
REL = 1e-6  # float32 sums differ by ~2e-7 between 1 and 2 threads; a real change moves the numbers by far more

GOLDEN = {
    "tokenizer": {
        "loss": [1.3059455752372742, 1.1168283224105835, 1.5960901975631714, 1.5444645285606384,
                 1.647359848022461, 1.3522188067436218, 1.428403913974762, 1.2250296473503113],
        "val_loss": [1.3315387487411499, 1.3265905022621154],
        "train_loss": [1.3908321559429169, 1.413253054022789],
    },
    "predictor": {
        "loss": [3.1661369800567627, 3.288072943687439, 3.115747809410095, 3.000737190246582,
                 2.9478960037231445, 3.12673282623291, 2.9639651775360107, 3.0971338748931885],
        "val_loss": [2.631796932220459, 2.6121049404144285],
        "train_loss": [3.1426737308502197, 3.0339319705963135],
    },
}


def logged(result) -> dict[str, list[float]]:
    records = read_metrics(result.metrics_path)
    return {
        "loss": [r["loss"] for r in records if r["kind"] == "train"],
        # Epoch 0 (the starting model, validated before the first step) is new since the pin; the trained epochs'
        # numbers must not move (it restores the random streams).
        "val_loss": [r["val_loss"] for r in records if r["kind"] == "val" and r["epoch"] > 0],
        "train_loss": [h["train_loss"] for h in result.history if h["epoch"] > 0],
    }


def test_tokenizer_then_predictor_losses_match_the_pinned_numbers(tmp_path):
    train_set, val_set = tiny_datasets()
    tok = tiny_tokenizer(dropout=0.1)
    got_tok = logged(train_tokenizer(tok, train_set, val_set, CFG, tmp_path / "tok", CPU))
    tok.eval()
    pred = tiny_predictor(dropout=0.1)
    got_pred = logged(train_predictor(pred, tok, train_set, val_set, replace(CFG, teacher_forcing=False),
                                      tmp_path / "pred", CPU))
    for stage, got in (("tokenizer", got_tok), ("predictor", got_pred)):
        assert len(got["val_loss"]) == 2, stage
        for key, expected in GOLDEN[stage].items():
            assert got[key] == pytest.approx(expected, rel=REL), f"{stage} {key}"
