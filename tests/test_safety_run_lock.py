"""The per-folder run lock: a second run fails at once naming the holder; a killed holder's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.utils.errors import RunLockedError
from finetune.utils.safety import LOCK_NAME, RunLock

ROOT = Path(__file__).resolve().parents[1]
HOLDER = """
import sys
from finetune.utils.safety import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
sys.stdin.read()          # hold until the parent closes stdin (or kills us)
lock.release()
print("released", flush=True)
"""


def start_holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
    return proc


def test_second_process_fails_at_once_naming_the_holder(tmp_path):
    proc = start_holder(tmp_path)
    try:
        with pytest.raises(RunLockedError) as info:
            RunLock(tmp_path, key="training.output_dir").acquire()
        msg = str(info.value)
        assert f"pid {proc.pid}" in msg and socket.gethostname() in msg and "started 20" in msg
        assert "set training.output_dir to a different folder" in msg
        assert info.value.holder.pid == proc.pid
        assert not isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    finally:
        out, _ = proc.communicate("", timeout=30)
    assert proc.returncode == 0 and "released" in out
    # Released by a clean exit: the file is gone and the next run gets the lock without a takeover.
    assert not (tmp_path / LOCK_NAME).exists()
    with RunLock(tmp_path) as lock:
        assert lock.held and lock.took_over is None


def test_killed_holder_leaves_a_stale_lock_that_is_taken_over_with_a_log_line(tmp_path):
    proc = start_holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close(), proc.stderr.close(), proc.stdin.close()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == proc.pid  # the file survived the kill
    lines: list[str] = []
    with RunLock(tmp_path, log=lines.append) as lock:
        assert lock.took_over is not None and lock.took_over.pid == proc.pid
        assert len(lines) == 1 and f"stale lock of pid {proc.pid}" in lines[0]
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_same_process_cannot_take_the_lock_twice_and_exceptions_release_it(tmp_path):
    with pytest.raises(KeyError), RunLock(tmp_path):
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
        raise KeyError("boom")
    assert not (tmp_path / LOCK_NAME).exists()
    RunLock(tmp_path).acquire().release()


def test_disabled_lock_is_a_no_op_and_an_unused_new_folder_is_removed(tmp_path):
    with RunLock(tmp_path / "off", enabled=False) as lock:
        assert not lock.held
    assert not (tmp_path / "off").exists()
    with RunLock(tmp_path / "new" / "run"):
        assert (tmp_path / "new" / "run" / LOCK_NAME).is_file()
    assert not (tmp_path / "new" / "run").exists()  # the run wrote nothing: no empty folder left behind
    with RunLock(tmp_path / "kept"):
        (tmp_path / "kept" / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["metrics.jsonl"]

