"""Kill and stop loops: a run SIGKILLed at random moments (>= 10 times, a checkpoint every step) or stopped with
SIGTERM, and re-run each time with the same command, ends with weights EQUAL to an uninterrupted run - in one
process and under torchrun with 2 gloo processes. Also: a locked folder refuses all ranks cleanly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from finetune.utils.checkpoint import list_checkpoints
from finetune.utils.metrics import read_metrics
from finetune.utils.safety import RunLock

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("engine_dist_worker.py")
ROOT = Path(__file__).resolve().parents[1]
# Predictor with dropout and sampled s1 (the RNG streams must resume too); 20 windows / batch 2 = 10 steps per epoch,
# 2 epochs = 20 steps, a checkpoint after every step; each batch fetch takes 50 ms so a kill can land mid-run.
ARGS = ["predictor", "--dropout", "0.1", "--batch-seconds", "0.05", "--set", "teacher_forcing=false",
        "--set", "max_train_samples=20", "--set", "batch_size=2", "--set", "save_every_steps=1"]
STEPS = 20


def command(out: Path, nproc: int) -> list[str]:
    """The run's command; under torchrun each rank takes 1 window per step (the same 20 steps)."""
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    per_rank = [] if nproc == 1 else ["--set", "batch_size=1"]
    return [*launcher, str(WORKER), ARGS[0], str(out), *ARGS[1:], *per_rank]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DIST_BACKEND": "gloo"}


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (torchrun starts its workers in their own sessions: killpg misses them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def signal_tree(pid: int, sig: int) -> None:
    """Send `sig` to `pid` and every descendant at once, as a scheduler ending a job does."""
    for p in process_tree(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def newest_step(out: Path) -> int:
    found = list_checkpoints(out / "checkpoints")
    return found[0][0] if found else 0


def interrupt_loop(
    out: Path, nproc: int, sig: int, times: int, rng: random.Random
) -> list[subprocess.CompletedProcess]:
    """Start the run, wait until it saved a new checkpoint, wait a random moment (0-2 steps), send `sig` to the
    whole process group; `times` times. Then run it to the end. Returns the interrupted runs' results."""
    interrupted = []
    while len(interrupted) < times:
        before = newest_step(out)
        proc = subprocess.Popen(command(out, nproc), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env(), start_new_session=True)
        deadline = time.monotonic() + 120
        while newest_step(out) <= before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if proc.poll() is not None:  # finished before we could interrupt it: nothing left to test
            assert proc.returncode == 0, proc.stderr.read()[-3000:]
            break
        time.sleep(rng.uniform(0.0, 0.08))
        signal_tree(proc.pid, sig)
        stdout, stderr = proc.communicate(timeout=120)
        interrupted.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    final = subprocess.run(command(out, nproc), capture_output=True, text=True, env=env(), timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    return interrupted


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final_state.pt")


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "torchrun2"])
def reference(request, tmp_path_factory):
    nproc = request.param
    out = tmp_path_factory.mktemp(f"whole{nproc}")
    whole = subprocess.run(command(out, nproc), capture_output=True, text=True, env=env(), timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return nproc, final_weights(out)


def assert_same_run(out: Path, expected: dict[str, torch.Tensor]) -> None:
    got = final_weights(out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, STEPS + 1))  # every step logged once
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no orphans left


def test_sigkill_at_random_moments_then_rerun_gives_the_uninterrupted_weights(tmp_path, reference):
    nproc, expected = reference
    runs = interrupt_loop(tmp_path, nproc, signal.SIGKILL, times=10, rng=random.Random(nproc))
    assert len(runs) == 10, "the run finished before it could be killed 10 times"
    assert all(r.returncode != 0 for r in runs)
    assert_same_run(tmp_path, expected)


def test_sigterm_stops_save_then_rerun_gives_the_uninterrupted_weights(tmp_path, reference):
    nproc, expected = reference
    runs = interrupt_loop(tmp_path, nproc, signal.SIGTERM, times=3, rng=random.Random(10 + nproc))
    assert len(runs) == 3
    for r in runs:
        assert "stopped on SIGTERM at step" in r.stderr, r.stderr[-3000:]
        assert "quitting now without saving" not in r.stderr
        if nproc == 1:
            assert r.returncode == 75 and "Traceback" not in r.stderr
    assert_same_run(tmp_path, expected)


def test_locked_folder_refuses_every_rank_without_hanging(tmp_path):
    with RunLock(tmp_path):
        job = subprocess.run(command(tmp_path, 2), capture_output=True, text=True, env=env(), timeout=120)
    assert job.returncode != 0
    assert job.stderr.count("another run is already writing into") >= 2  # rank 0 and rank 1 both say why
    assert not (tmp_path / "checkpoints").exists()
