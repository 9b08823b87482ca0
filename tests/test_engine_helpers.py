"""The engine's process-wide helpers and its accumulator: LossSums, seeding, the fault hook, logging, Trainer state."""

from __future__ import annotations

import logging
import math
import random
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from finetune.utils.distributed import DistInfo, seed_everything, seeded_init
from finetune.utils.errors import setup_logging
from finetune.utils.precision import resolve_precision
from finetune.utils.safety import FAULT_ENV, maybe_die_after_step
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import TokenizerStage, Trainer
from finetune.utils.validate import LossSums, Validator
from tests.engine_dist_worker import tiny_datasets, tiny_tokenizer

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_loss_sums_weight_each_batch_by_its_windows():
    sums = LossSums(("a", "b"), torch.device("cpu"))
    sums.add(torch.tensor(1.0), {"b": torch.tensor(10.0), "a": torch.tensor(2.0)}, n=3)  # parts read by name
    sums.add(torch.tensor(4.0), {"a": torch.tensor(5.0), "b": torch.tensor(20.0)}, n=1)
    totals = sums.reduce(extra=[0.5, 2.0])
    assert totals.windows == 4 and totals.extra == (0.5, 2.0)
    assert totals.mean("loss") == pytest.approx((1 * 3 + 4) / 4)  # not the mean of batch means (2.5)
    assert totals.means(prefix="val_") == pytest.approx({"val_loss": 1.75, "val_a": 11 / 4, "val_b": 50 / 4})
    assert sums.reduce().windows == 4  # reduce leaves the running sums alone


def test_loss_sums_carry_a_resumed_epoch_and_report_nan_without_windows():
    assert math.isnan(LossSums(("a",), torch.device("cpu")).reduce().mean("loss"))
    carried = LossSums(("a",), torch.device("cpu"), loss_sum=6.0, windows=3)
    carried.add(torch.tensor(3.0), {"a": torch.tensor(0.0)}, n=1)
    assert carried.reduce().mean("loss") == pytest.approx(9.0 / 4)
    with pytest.raises(KeyError):
        carried.add(torch.tensor(1.0), {"other": torch.tensor(0.0)}, n=1)


def test_a_sampled_forecast_metric_leaves_the_training_random_streams_where_they_were():
    _, val_set = tiny_datasets()
    cfg = TrainingConfig(batch_size=4, num_workers=0, select_by="draws")
    draws = lambda model: {"score": float(torch.rand(()) + np.random.rand() + random.random())}  # noqa: E731
    validator = Validator(TokenizerStage(tiny_tokenizer()), val_set, cfg, CPU, resolve_precision("none", CPU.device),
                          draws)
    seed_everything(5, 0)
    expected = (torch.rand(2), np.random.rand(2), random.random())
    seed_everything(5, 0)
    sel = validator.validate_and_select(validator.stage.model, 1, math.inf, 0)
    assert 0 < sel.values["score"] == sel.values["metric_score"] < 3  # it drew, and selected by its score
    got = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_seeded_init_gives_the_same_weights_and_leaves_the_global_streams_alone():
    seed_everything(5)
    expected_next = torch.rand(3)
    seed_everything(5)
    with seeded_init(123):
        a = torch.nn.Linear(4, 4).weight.detach().clone()
    assert torch.equal(torch.rand(3), expected_next)  # the global stream did not move
    with seeded_init(123):
        b = torch.nn.Linear(4, 4).weight.detach().clone()
    with seeded_init(124):
        c = torch.nn.Linear(4, 4).weight.detach().clone()
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_the_trainer_seeds_each_run_whatever_the_process_did_before(tmp_path):
    # A stage's random stream depends on (seed, rank) only: e.g. not on whether an earlier stage ran in the process.
    cfg = TrainingConfig(epochs=1, batch_size=4, max_train_samples=8, num_workers=0, progress_bar=False, seed=3)
    train_set, val_set = tiny_datasets()
    draws = []
    for noise in (0, 1):
        random.random(), np.random.rand(), torch.rand(noise + 1)  # disturb the global streams differently
        Trainer(TokenizerStage(tiny_tokenizer()), train_set, val_set, cfg, tmp_path / str(noise), CPU)
        draws.append((random.random(), float(np.random.rand()), torch.rand(2)))
    assert draws[0][:2] == draws[1][:2] and torch.equal(draws[0][2], draws[1][2])


def test_fault_hook_exits_only_at_its_step_and_rank(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    maybe_die_after_step(1, 0)  # unset: nothing happens
    monkeypatch.setenv(FAULT_ENV, "3")
    monkeypatch.setenv("KRONOS_FAULT_RANK", "1")
    maybe_die_after_step(2, 1)  # another step
    maybe_die_after_step(3, 0)  # another rank
    code = ("from finetune.utils.safety import maybe_die_after_step as die\n"
            "die(2, 1); die(3, 1); print('survived')")
    env = {FAULT_ENV: "3", "KRONOS_FAULT_RANK": "1", "KRONOS_FAULT_EXIT_CODE": "5"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**_env(), **env})
    assert proc.returncode == 5 and "survived" not in proc.stdout


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("KRONOS_FAULT")}




def test_logging_other_ranks_only_warn_and_only_rank_zero_writes_the_file(tmp_path, capsys, restore_root_logger):
    log = logging.getLogger("kronos.test")
    setup_logging(rank=1, log_file=tmp_path / "r1.log")
    log.info("progress line")
    log.warning("disk almost full")
    err = capsys.readouterr().err
    assert "progress line" not in err and "[rank 1] disk almost full" in err
    assert not (tmp_path / "r1.log").exists()

    setup_logging(rank=0, log_file=tmp_path / "r0.log")  # replaces the handlers of the first call
    log.info("progress line")
    err = capsys.readouterr().err
    assert err.count("progress line") == 1
    assert "INFO progress line" in (tmp_path / "r0.log").read_text()


def test_engine_progress_lines_go_through_logging(tmp_path, caplog):
    train_set, val_set = tiny_datasets()
    cfg = TrainingConfig(epochs=1, batch_size=4, max_train_samples=8, num_workers=0, progress_bar=False)
    with caplog.at_level(logging.INFO, logger="finetune.utils"):
        Trainer(TokenizerStage(tiny_tokenizer()), train_set, val_set, cfg, tmp_path, CPU).fit()
        Trainer(TokenizerStage(tiny_tokenizer()), train_set, val_set, replace(cfg, resume="auto"), tmp_path,
                CPU).fit()
    messages = [r.getMessage() for r in caplog.records
                if r.name in ("finetune.utils.training_utils", "finetune.utils.ledger")]
    assert any(m.startswith("[tokenizer] epoch 1/1  train ") for m in messages)
    assert any(m.startswith("[tokenizer] starting model  val ") for m in messages)
    assert any(m.endswith("already holds a finished run; skipping it (--overwrite or training.overwrite=true "
                          "trains it again)") for m in messages)
