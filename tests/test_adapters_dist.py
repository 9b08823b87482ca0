"""Finetune modes across processes: a killed lora run resumed ends with the uninterrupted weights, and a 2-process
DDP lora run (gloo) equals one process on the combined batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.utils.checkpoint import load_checkpoint
from finetune.utils.metrics import read_metrics
from finetune.utils.safety import FAULT_ENV
from tests.conftest import cpu_env
from tests.engine_dist_worker import tiny_predictor

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("engine_dist_worker.py")
LORA = ["--set", "finetune_mode=lora", "--set", "lora_targets=[attention, heads]", "--set", "lr=1e-2"]


def env(**extra: str) -> dict[str, str]:
    return cpu_env(OMP_NUM_THREADS="1", DIST_BACKEND="gloo", **extra)


def test_killed_lora_run_resumed_ends_with_the_uninterrupted_weights(tmp_path):
    # lora dropout on and s1 sampled: the RNG streams must resume too. 16 windows / batch 4 = 4 steps per epoch,
    # 2 epochs; last.pt every 2 steps; the kill comes after step 3 (mid-epoch) and again after step 6.
    args = ["predictor", "--set", "teacher_forcing=false", "--set", "max_train_samples=16", "--set",
            "save_every_steps=2", "--set", "lora_dropout=0.1", *LORA]

    def run(out: Path, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(WORKER), args[0], str(out), *args[1:]], capture_output=True,
                              text=True, timeout=240, env=env(**extra))

    log = (tmp_path / "whole.log").open("w")  # a file, not a pipe: nothing reads it until the end
    whole = subprocess.Popen([sys.executable, str(WORKER), args[0], str(tmp_path / "whole"), *args[1:]],
                             stdout=log, stderr=subprocess.STDOUT, env=env())  # beside the killed runs
    for step, saved in ((3, 2), (6, 6)):
        killed = run(tmp_path / "resumed", **{FAULT_ENV: str(step)})
        assert killed.returncode == 17, killed.stderr
        assert load_checkpoint(tmp_path / "resumed/checkpoints/last.pt")["loop"]["global_step"] == saved
    assert run(tmp_path / "resumed").returncode == 0
    assert whole.wait(timeout=240) == 0, (tmp_path / "whole.log").read_text()[-3000:]
    log.close()

    a = torch.load(tmp_path / "whole/final_state.pt")
    b = torch.load(tmp_path / "resumed/final_state.pt")
    assert a.keys() == b.keys() == tiny_predictor().state_dict().keys()  # merged: the published keys
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_metrics(tmp_path / "resumed/metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 9))


def test_two_ranks_lora_with_accumulation_match_one_process_with_the_global_batch(tmp_path):
    # One process: steps of 4 windows. Two ranks: 1 window per micro-batch, 2 micro-batches per step = 4 windows
    # per step too, the same ones (the sampler deals the epoch's order round-robin).
    common = ["predictor", "--set", "epochs=1", "--set", "max_train_samples=8", *LORA]
    single = subprocess.run([sys.executable, str(WORKER), common[0], str(tmp_path / "one"), *common[1:],
                             "--set", "batch_size=4"], capture_output=True, text=True, timeout=180, env=env())
    assert single.returncode == 0, single.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(WORKER), common[0], str(tmp_path / "two"), *common[1:], "--set", "batch_size=1",
                          "--set", "accumulation_steps=2"], capture_output=True, text=True, timeout=180, env=env())
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = torch.load(tmp_path / "one/final_state.pt"), torch.load(tmp_path / "two/final_state.pt")
    start = tiny_predictor().state_dict()
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the adapters did move the (merged) weights
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)
    # the adapters of both runs (rank 0's checkpoint) are the same too, and hold the adapters only
    ca = load_checkpoint(tmp_path / "one/checkpoints/last.pt")["model"]
    cb = load_checkpoint(tmp_path / "two/checkpoints/last.pt")["model"]
    assert ca.keys() == cb.keys() and all(".lora_" in k for k in ca)
    for k in ca:
        torch.testing.assert_close(ca[k], cb[k], rtol=1e-4, atol=1e-6, msg=k)
