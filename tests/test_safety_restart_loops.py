"""Kill and stop loops: a run SIGKILLed 3 times (a checkpoint every step; kills in both epochs, one right after the
epoch boundary, each at a random moment within a step) or stopped with SIGTERM (twice; once under torchrun), and
re-run each time with the same command, ends with weights EQUAL to an uninterrupted run - in one process and under
torchrun with 2 gloo processes. Also: a locked folder refuses all ranks cleanly."""

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
from tests.conftest import cpu_env

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("engine_dist_worker.py")
ROOT = Path(__file__).resolve().parents[1]
# Predictor with dropout and sampled s1 (the RNG streams must resume too); 10 windows / batch 2 = 5 steps per epoch,
# 2 epochs = 10 steps, a checkpoint after every step (the 2 newest kept: every save from step 3 on rotates one out);
# each batch fetch takes 50 ms so a kill can land mid-step.
ARGS = ["predictor", "--dropout", "0.1", "--batch-seconds", "0.05", "--set", "teacher_forcing=false",
        "--set", "max_train_samples=10", "--set", "batch_size=2", "--set", "save_every_steps=1"]
STEPS_PER_EPOCH, STEPS = 5, 10


def command(out: Path, nproc: int) -> list[str]:
    """The run's command; under torchrun each rank takes 1 window per step (the same 10 steps)."""
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    per_rank = [] if nproc == 1 else ["--set", "batch_size=1"]
    return [*launcher, str(WORKER), ARGS[0], str(out), *ARGS[1:], *per_rank]


def env() -> dict[str, str]:
    return cpu_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DIST_BACKEND="gloo")


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


def kill_targets(times: int, rng: random.Random) -> list[int]:
    """`times` checkpoint steps to interrupt after, increasing: about half in epoch 1, one at the epoch boundary (the
    last step of epoch 1: validation and best-model writing follow it), the rest in epoch 2 (never the last step)."""
    first = times // 2
    return [*sorted(rng.sample(range(1, STEPS_PER_EPOCH), first)), STEPS_PER_EPOCH,
            *sorted(rng.sample(range(STEPS_PER_EPOCH + 1, STEPS - 1), times - 1 - first))]


def interrupt_loop(
    out: Path, nproc: int, sig: int, times: int, rng: random.Random
) -> list[tuple[int, subprocess.CompletedProcess]]:
    """For each of `kill_targets`: start the run, wait until it saved the target step (and at least one new step),
    wait a random moment (0-1.6 steps), send `sig` to the whole process tree. Then run it to the end. Returns the
    newest checkpoint step at each interruption, with the interrupted run's result."""
    interrupted = []
    for target in kill_targets(times, rng):
        target = max(target, newest_step(out) + 1)
        proc = subprocess.Popen(command(out, nproc), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env(), start_new_session=True)
        deadline = time.monotonic() + 120
        while newest_step(out) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, f"the run ended before it could be interrupted after step {target}: " + (
            proc.stderr.read()[-3000:])
        time.sleep(rng.uniform(0.0, 0.08))
        signal_tree(proc.pid, sig)
        stdout, stderr = proc.communicate(timeout=120)
        interrupted.append((newest_step(out), subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)))
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
    # 3 kills: before, at and after the epoch boundary, each at a random moment within its step
    runs = interrupt_loop(tmp_path, nproc, signal.SIGKILL, times=3, rng=random.Random(nproc))
    assert all(r.returncode != 0 for _, r in runs)
    saved = [step for step, _ in runs]
    assert saved == sorted(set(saved)) and saved[0] < STEPS_PER_EPOCH < saved[-1] < STEPS, saved  # both epochs
    assert_same_run(tmp_path, expected)


def test_sigterm_stops_save_then_rerun_gives_the_uninterrupted_weights(tmp_path, reference):
    nproc, expected = reference
    # two stops in one process (a resumed run stopped again); one under torchrun (all ranks agree and save)
    runs = interrupt_loop(tmp_path, nproc, signal.SIGTERM, times=2 if nproc == 1 else 1, rng=random.Random(10 + nproc))
    for _, r in runs:
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
