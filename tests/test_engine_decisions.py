"""Small pure decisions of the engine (early stopping, log/save steps, step counts) and process setup."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from finetune.utils.checkpoint import rng_state, set_rng_state
from finetune.utils.distributed import (
    distributed_context,
    launched_by_torchrun,
    require_torchrun,
    resolve_backend,
    seed_everything,
)
from finetune.utils.training_utils import (
    micro_batch_sizes,
    optimizer_steps_per_epoch,
    should_log,
    should_save_checkpoint,
    step_batch_sizes,
)
from finetune.utils.validate import update_early_stopping
from model.errors import UserError


def run_early_stopping(losses, patience, min_delta=0.0):
    best, bad, trace = math.inf, 0, []
    for loss in losses:
        d = update_early_stopping(best, bad, loss, patience, min_delta)
        best, bad = d.best, d.bad_epochs
        trace.append((d.improved, d.stop))
        if d.stop:
            break
    return best, trace


def test_early_stopping_stops_after_patience_epochs_without_improvement():
    best, trace = run_early_stopping([1.0, 0.8, 0.9, 0.85, 0.7], patience=2)
    assert best == 0.8
    assert trace == [(True, False), (True, False), (False, False), (False, True)]


def test_early_stopping_disabled_with_patience_zero_and_min_delta_counts():
    best, trace = run_early_stopping([1.0, 1.1, 1.2, 1.3], patience=0)
    assert best == 1.0 and not any(stop for _, stop in trace) and len(trace) == 4
    # 0.995 is not better than 1.0 by more than min_delta=0.01
    d = update_early_stopping(1.0, 0, 0.995, patience=5, min_delta=0.01)
    assert (d.improved, d.best, d.bad_epochs) == (False, 1.0, 1)


def test_nan_validation_loss_never_counts_as_improvement():
    d = update_early_stopping(math.inf, 0, math.nan, patience=1)
    assert not d.improved and d.stop and d.best == math.inf


def test_checkpoint_and_log_steps():
    assert [s for s in range(1, 11) if should_save_checkpoint(s, 4)] == [4, 8]
    assert not any(should_save_checkpoint(s, 0) for s in range(1, 11))
    assert [s for s in range(1, 8) if should_log(s, 3, last_step_of_epoch=(s == 7))] == [3, 6, 7]


@pytest.mark.parametrize(
    "samples, batch, accum, sizes, steps",
    [(10, 4, 1, [4, 4, 2], 3), (10, 4, 2, [4, 4, 2], 2), (8, 4, 2, [4, 4], 1), (3, 4, 3, [3], 1),
     (9, 1, 4, [1] * 9, 3)],
)
def test_micro_batches_and_optimizer_steps(samples, batch, accum, sizes, steps):
    assert micro_batch_sizes(samples, batch) == sizes
    assert optimizer_steps_per_epoch(samples, batch, accum) == steps
    # The steps' micro-batches cover the epoch's exactly once, in order; past the last step there are none.
    per_step = [step_batch_sizes(sizes, s, accum) for s in range(steps)]
    assert all(1 <= len(p) <= accum for p in per_step) and sum(per_step, []) == sizes
    assert step_batch_sizes(sizes, steps, accum) == []


def test_backend_choice_and_nccl_without_cuda_message():
    assert resolve_backend(None, cuda_available=False) == "gloo"
    assert resolve_backend("", cuda_available=True) == "nccl"
    assert resolve_backend("GLOO", cuda_available=True) == "gloo"
    with pytest.raises(ValueError, match="set DIST_BACKEND=gloo"):
        resolve_backend("nccl", cuda_available=False)
    with pytest.raises(ValueError, match="not a torch.distributed backend"):
        resolve_backend("tcp", cuda_available=False)


def test_distributed_context_refuses_nccl_on_cpu_before_creating_a_group(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "DIST_BACKEND": "nccl",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="DIST_BACKEND=gloo"):
        with distributed_context(timeout_s=5):
            pass
    assert not torch.distributed.is_initialized()


def test_single_process_without_torchrun_is_a_world_of_one(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert not launched_by_torchrun()
    with distributed_context() as dist:
        assert (dist.rank, dist.world_size, dist.is_main, dist.distributed) == (0, 1, True, False)
        assert dist.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UserError, match=r"torchrun --standalone --nproc_per_node=1 finetune/train_x.py"):
        require_torchrun("finetune/train_x.py")
    assert launched_by_torchrun({"RANK": "1", "WORLD_SIZE": "2"})


def test_seed_plus_rank_and_rng_state_round_trip():
    assert seed_everything(100, rank=3) == 103
    a = torch.rand(3)
    seed_everything(100, rank=0)
    assert not torch.equal(torch.rand(3), a)  # another rank, another stream
    saved = rng_state()
    expected = (torch.rand(2), np.random.rand(2), random.random())
    set_rng_state(saved)
    again = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(expected[0], again[0]) and (expected[1] == again[1]).all() and expected[2] == again[2]


def test_resume_setting(tmp_path):
    from finetune.utils.errors import StageFolderError
    from finetune.utils.ledger import plan_run

    assert plan_run(tmp_path, "auto", False, "tokenizer").action == "fresh"
    assert plan_run(tmp_path, "never", False, "tokenizer").action == "fresh"
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"x")
    assert plan_run(tmp_path, "auto", False, "tokenizer").action == "resume"
    # a run folder given as training.resume resumes its newest checkpoint (into a new, empty folder)
    other = plan_run(tmp_path / "other", str(tmp_path), False, "tokenizer")
    assert (other.action, other.checkpoint) == ("resume", str(tmp_path / "checkpoints" / "last.pt"))
    with pytest.raises(StageFolderError, match="training.resume"):
        plan_run(tmp_path / "other", str(tmp_path / "missing.pt"), False, "tokenizer")
