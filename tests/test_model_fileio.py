"""model/fileio.py: atomic files and folders, strict JSON, a full disk reported with numbers."""
import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from model.fileio import atomic_dir, atomic_write, write_json


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def test_atomic_write_replaces_and_sets_ordinary_permissions(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")
    atomic_write(target, lambda p: Path(p).write_text("new"))
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_atomic_write_failure_keeps_old_file_and_removes_temp(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")

    def boom(p):
        Path(p).write_text("half")
        raise RuntimeError("killed")
    with pytest.raises(RuntimeError, match="killed"):
        atomic_write(target, boom)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_disk_full_names_file_free_space_and_bytes_written(tmp_path):
    target = tmp_path / "model.safetensors"

    def full(p):
        Path(p).write_bytes(b"x" * 1234)
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as info:
        atomic_write(target, full)
    msg = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert str(target) in msg and "1234 bytes written" in msg and "GiB" in msg and "free" in msg
    assert list(tmp_path.iterdir()) == []
    # another OSError is passed through unchanged
    with pytest.raises(PermissionError):
        atomic_write(target, lambda p: (_ for _ in ()).throw(PermissionError(errno.EACCES, "denied")))
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_success_replace_and_failure(tmp_path):
    target = tmp_path / "best_model"
    with atomic_dir(target) as d:
        (d / "config.json").write_text("1")
        assert not target.exists()  # built under another name
    assert (target / "config.json").read_text() == "1"
    assert target.stat().st_mode & 0o777 == 0o777 & ~_umask()
    with atomic_dir(target) as d:
        (d / "model.safetensors").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]  # the old folder is replaced whole
    with pytest.raises(RuntimeError), atomic_dir(target) as d:
        (d / "partial").write_text("x")
        raise RuntimeError("crash")
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_model"]  # no temporary folder left
    with pytest.raises(FileExistsError, match="already exists"), atomic_dir(target, overwrite=False):
        pass


def test_write_json_is_strict(tmp_path):
    path = write_json(tmp_path / "m.json", {"loss": float("nan"), "best": float("inf"), "xs": (1.5, -float("inf")),
                                           "n": np.float32(2.5), "ok": 1})
    text = path.read_text()
    assert json.loads(text) == {"loss": None, "best": None, "xs": [1.5, None], "n": 2.5, "ok": 1}
    assert "NaN" not in text and "Infinity" not in text and text.endswith("\n") and '\n  "loss"' in text
    with pytest.raises(TypeError):
        write_json(tmp_path / "bad.json", {"x": object()})
    assert not (tmp_path / "bad.json").exists()
