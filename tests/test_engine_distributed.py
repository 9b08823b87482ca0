"""Two gloo processes under torchrun: DDP updates equal one big batch, and a dying rank fails the job fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.utils.metrics import read_metrics
from finetune.utils.safety import FAULT_ENV
from tests.conftest import cpu_env
from tests.engine_dist_worker import tiny_predictor, tiny_tokenizer

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("engine_dist_worker.py")
# Tokenizer without the codebook-entropy term (entropy of the batch-averaged code usage is not a mean over
# windows, so it legitimately depends on the per-rank batch); everything else is a per-window mean.
COMMON = ["both", "--gamma", "0", "--set", "epochs=1", "--set", "max_train_samples=8"]


def torchrun(out: Path, *args: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           COMMON[0], str(out), *COMMON[1:], *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=cpu_env(DIST_BACKEND="gloo", OMP_NUM_THREADS="1", **(env or {})))


def test_two_ranks_with_accumulation_match_one_process_with_the_global_batch(tmp_path):
    # One process: steps of 4 windows. Two ranks: 1 window per micro-batch, 2 micro-batches per step (no_sync on
    # the first) = 4 windows per step too, the same ones (the sampler deals the epoch's order round-robin).
    single = subprocess.run([sys.executable, str(WORKER), COMMON[0], str(tmp_path / "one"), *COMMON[1:],
                             "--set", "batch_size=4"], capture_output=True, text=True, timeout=180)
    assert single.returncode == 0, single.stderr
    dist = torchrun(tmp_path / "two", "--set", "batch_size=1", "--set", "accumulation_steps=2")
    assert dist.returncode == 0, dist.stderr[-3000:]

    for stage in ("tokenizer", "predictor"):
        a = torch.load(tmp_path / "one" / stage / "final_state.pt")
        b = torch.load(tmp_path / "two" / stage / "final_state.pt")
        initial = (tiny_tokenizer() if stage == "tokenizer" else tiny_predictor()).state_dict()
        assert any(not torch.equal(a[k], initial[k]) for k in a)  # training did move the weights
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=f"{stage}: {k}")
        ra = json.loads((tmp_path / "one" / stage / "result.json").read_text())
        rb = json.loads((tmp_path / "two" / stage / "result.json").read_text())
        assert rb["world_size"] == 2 and ra["global_step"] == rb["global_step"] == 2
        # Validation over 5 windows split 3 + 2 across the ranks: the sample-weighted mean equals one process's.
        assert ra["history"][0]["val_windows"] == rb["history"][0]["val_windows"] == 5
        if stage == "predictor":
            assert rb["history"][0]["val_loss"] == pytest.approx(ra["history"][0]["val_loss"], rel=1e-5)
        # Only rank 0 logged: each step appears once.
        steps = [r["step"] for r in read_metrics(tmp_path / "two" / stage / "metrics.jsonl") if r["kind"] == "train"]
        assert steps == [1, 2]


def test_a_rank_that_dies_fails_the_whole_job_without_hanging(tmp_path):
    fault = {FAULT_ENV: "1", "KRONOS_FAULT_RANK": "1", "KRONOS_FAULT_EXIT_CODE": "1"}
    # timeout=60: a hang (rank 0 waiting forever in a collective) fails the test with TimeoutExpired.
    job = torchrun(tmp_path / "dies", "--set", "batch_size=1", env=fault, timeout=60)
    assert job.returncode != 0
    assert not (tmp_path / "dies" / "tokenizer" / "final_state.pt").exists()
