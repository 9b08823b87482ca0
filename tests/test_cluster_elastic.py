"""Under `torchrun --max-restarts=N`, a killed worker is restarted and the job recovers EVERY time
(torchrun's shared rendezvous store kept the previous attempt's addresses: restarts failed or hung in process-group
setup), ending with the uninterrupted run's weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import cpu_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "engine_dist_worker.py"
# 2 ranks x 1 window per step, 10 steps per epoch, 1 epoch, a checkpoint after every step.
ARGS = ["predictor", "--dropout", "0.1", "--set", "epochs=1", "--set", "max_train_samples=20", "--set", "batch_size=1",
        "--set", "save_every_steps=1"]
TRIALS = 2  # two fresh jobs, each killed at a different step; both must recover


def torchrun(out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *extra,
           str(WORKER), ARGS[0], str(out), *ARGS[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=cpu_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DIST_BACKEND="gloo", **(env or {})))


def test_a_killed_worker_is_restarted_and_the_run_recovers_every_time(tmp_path):
    whole = torchrun(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = torch.load(tmp_path / "whole" / "final_state.pt")
    for trial in range(TRIALS):
        out = tmp_path / f"trial{trial}"
        # Rank 1 dies after optimizer step 3 + 4 * trial (its checkpoint written), as a killed process would.
        job = torchrun(out, "--max-restarts=2", env={"KRONOS_FAULT_EXIT_AFTER_STEP": str(3 + 4 * trial),
                                                     "KRONOS_FAULT_RANK": "1"})
        assert job.returncode == 0, f"trial {trial}: " + job.stderr[-3000:]
        assert "exitcode: 17" in job.stderr, f"trial {trial}: no worker was killed"
        got = torch.load(out / "final_state.pt")
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), trial
