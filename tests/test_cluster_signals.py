"""A group SIGTERM (Slurm's time limit or preemption) with DataLoader workers saves and the
re-run ends with the uninterrupted weights; a double Ctrl-C never prints a traceback; a best-model swap never
leaves `best_model/` absent, and a swap killed half-way is repaired."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import model.fileio
from finetune.utils.checkpoint import list_checkpoints, remove_orphans
from model.fileio import atomic_dir
from tests.conftest import cpu_env
from tests.test_safety_restart_loops import process_tree

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "engine_dist_worker.py"
# 20 windows / batch 2 = 10 steps per epoch, 2 epochs; each batch takes 50 ms; two loader workers.
ARGS = ["predictor", "--dropout", "0.1", "--batch-seconds", "0.05", "--set", "max_train_samples=20",
        "--set", "batch_size=2", "--set", "save_every_steps=1", "--set", "num_workers=2"]


def command(out: Path, nproc: int) -> list[str]:
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, str(WORKER), ARGS[0], str(out), *ARGS[1:], *([] if nproc == 1 else ["--set", "batch_size=1"])]


def env() -> dict[str, str]:
    return cpu_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DIST_BACKEND="gloo")


def newest_step(out: Path) -> int:
    found = list_checkpoints(out / "checkpoints")
    return found[0][0] if found else 0


def stop_with_group_sigterm(out: Path, nproc: int) -> subprocess.CompletedProcess:
    """Start the run in its own process group, wait for its second checkpoint, SIGTERM the whole group (what
    `kill -TERM -- -PGID` and Slurm do), and wait for it to end."""
    proc = subprocess.Popen(command(out, nproc), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while newest_step(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    workers = len(process_tree(proc.pid)) - 1
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert workers >= 2 * nproc, "the loader workers should have been running"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2], ids=["torchrun2"])  # one process: test_safety_restart_loops' SIGTERM loop
def test_group_sigterm_with_loader_workers_saves_and_resumes_to_the_uninterrupted_weights(tmp_path, nproc):
    whole = subprocess.run(command(tmp_path / "whole", nproc), capture_output=True, text=True, env=env(),
                           timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "stopped"
    stopped = stop_with_group_sigterm(out, nproc)
    assert "stopped on SIGTERM at step" in stopped.stderr, stopped.stderr[-3000:]
    assert "killed by signal" not in stopped.stderr
    if nproc == 1:
        assert stopped.returncode == 75 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    # torchrun itself reports a failed child (exit 1) whatever the workers return: scripts/slurm_multinode.sbatch
    # maps a stop it asked for to 75.
    rerun = subprocess.run(command(out, nproc), capture_output=True, text=True, env=env(), timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    expected, got = torch.load(tmp_path / "whole" / "final_state.pt"), torch.load(out / "final_state.pt")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


# ------------------------------------------------------------------------------------------ double Ctrl-C
SLOW_EXIT = textwrap.dedent("""
    import atexit, sys, time
    from finetune.utils.errors import run_main

    def main(argv):
        atexit.register(time.sleep, 3)  # a slow way out: cleanup, thread joins, flushing trackers
        print("ready", flush=True)
        time.sleep(60)

    sys.exit(run_main(main, []))
""")


def test_a_second_ctrl_c_while_exiting_quits_with_one_line_and_no_traceback():
    proc = subprocess.Popen([sys.executable, "-c", SLOW_EXIT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)  # now in the slow exit
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "interrupted again; quitting now" in stderr


# ------------------------------------------------------------------------------------------ best_model swaps
def write_model(folder: Path, tag: str) -> None:
    (folder / "config.json").write_text(tag)
    (folder / "model.safetensors").write_text(tag)


def test_best_model_is_never_absent_while_it_is_replaced(tmp_path):
    target = tmp_path / "best_model"
    with atomic_dir(target) as tmp:
        write_model(tmp, "0")
    # A reader in another process polls the folder (no GIL shared with the writer) while it is swapped 300 times.
    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys
        p = {str(target / "config.json")!r}
        print("ready", flush=True)
        while not os.path.exists({str(tmp_path / "done")!r}):
            if not os.path.exists(p):
                print("missing", flush=True); break
    """)], stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "ready"
    for i in range(1, 301):
        with atomic_dir(target) as tmp:
            write_model(tmp, str(i))
    (tmp_path / "done").touch()
    assert reader.communicate(timeout=30)[0].strip() == ""
    assert (target / "config.json").read_text() == "300"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_model", "done"]  # nothing left beside it


def killed_mid_swap(tmp_path: Path, keep_target: bool) -> Path:
    """What the move-aside swap leaves when killed between its two renames (or after them, before the cleanup)."""
    old = tmp_path / ".best_model.abcd1234.old" / "x"
    old.mkdir(parents=True)
    write_model(old, "old")
    (old / "run_info.json").write_text("{}")
    if keep_target:
        (tmp_path / "best_model").mkdir()
        write_model(tmp_path / "best_model", "new")
    return tmp_path / "best_model"


def test_leftover_of_a_finished_swap_is_removed(tmp_path):
    best = killed_mid_swap(tmp_path, keep_target=True)
    remove_orphans(tmp_path, log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_model"]
    assert (best / "config.json").read_text() == "new"


def test_a_swap_killed_between_its_renames_gets_the_old_model_back(tmp_path):
    best = killed_mid_swap(tmp_path, keep_target=False)
    lines: list[str] = []
    remove_orphans(tmp_path, log=lines.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_model"]
    assert (best / "config.json").read_text() == "old" and "restored" in " ".join(lines)


def test_without_an_atomic_exchange_the_swap_still_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(model.fileio, "_exchange", lambda a, b: False)  # e.g. NFS, macOS
    for tag in ("a", "b"):
        with atomic_dir(tmp_path / "best_model") as tmp:
            write_model(tmp, tag)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_model"]
    assert (tmp_path / "best_model" / "config.json").read_text() == "b"
