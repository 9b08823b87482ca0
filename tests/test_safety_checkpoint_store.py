"""Rotating checkpoints: atomic step files + last.pt, fallback past broken files, disk-full errors, orphan cleanup."""

from __future__ import annotations

import argparse
import errno
import os
import resource
import shutil
import signal
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from finetune.utils import checkpoint as store
from finetune.utils.checkpoint import LAST_NAME, list_checkpoints, load_latest, prepare_folder, remove_orphans, save
from finetune.utils.errors import CheckpointError, CheckpointWriteError, NonFiniteWeightsError


def state(step: int) -> dict:
    return {"format": "test", "step": step, "model": {"w": torch.full((4, 4), float(step))}, "rng": [1, 2]}


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_save_rotates_keeps_k_and_last_is_the_newest(tmp_path):
    for step in (10, 20, 30):
        path = save(state(step), tmp_path, step)
        assert path == tmp_path / f"step-{step:08d}.pt"
    assert names(tmp_path) == [LAST_NAME, "step-00000020.pt", "step-00000030.pt"]
    assert torch.load(tmp_path / LAST_NAME, weights_only=True)["step"] == 30
    assert os.path.samefile(tmp_path / LAST_NAME, tmp_path / "step-00000030.pt")  # a hard link: no extra space
    save(state(40), tmp_path, 40, keep=1)
    assert names(tmp_path) == [LAST_NAME, "step-00000040.pt"]
    path, loaded = load_latest(tmp_path)
    assert path.name == "step-00000040.pt" and loaded["step"] == 40
    torch.testing.assert_close(loaded["model"]["w"], torch.full((4, 4), 40.0))
    with pytest.raises(ValueError, match="keep must be >= 1"):
        save(state(50), tmp_path, 50, keep=0)


def test_saving_an_earlier_step_deletes_the_replaced_later_history(tmp_path):
    for step in (10, 20, 30):
        save(state(step), tmp_path, step, keep=3)
    lines: list[str] = []
    save(state(15), tmp_path, 15, keep=2, log=lines.append)  # the run resumed from step 10
    assert names(tmp_path) == [LAST_NAME, "step-00000010.pt", "step-00000015.pt"]
    assert len(lines) == 1 and "step-00000030.pt, step-00000020.pt" in lines[0]
    assert load_latest(tmp_path)[1]["step"] == 15


def test_copy_fallback_when_hard_links_are_not_supported(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(store.os, "link", no_link)
    save(state(1), tmp_path, 1)
    save(state(2), tmp_path, 2)
    assert not os.path.samefile(tmp_path / LAST_NAME, tmp_path / "step-00000002.pt")
    assert torch.load(tmp_path / LAST_NAME, weights_only=True)["step"] == 2
    assert names(tmp_path) == [LAST_NAME, "step-00000001.pt", "step-00000002.pt"]


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "truncated or corrupt"),
    ("garbage", "not a torch checkpoint"),
    ("empty", "empty file (0 bytes)"),
])
def test_a_broken_newest_file_is_reported_by_path_and_the_previous_is_used(tmp_path, damage, reason):
    save(state(1), tmp_path, 1)
    newest = save(state(2), tmp_path, 2)
    data = newest.read_bytes()
    (tmp_path / LAST_NAME).unlink()  # damage the step file alone (last.pt would share the inode)
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        newest.write_bytes(b"this is not a checkpoint\n" * 50)
    else:
        newest.write_bytes(b"")
    lines: list[str] = []
    path, loaded = load_latest(tmp_path, log=lines.append)
    assert path.name == "step-00000001.pt" and loaded["step"] == 1
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {newest} is unusable: {reason}")
    assert "using the previous one, step-00000001.pt" in lines[0]
    assert "weights_only=False" not in lines[0]


def test_unsafe_pickle_is_refused_without_advising_an_unsafe_load(tmp_path):
    # A foreign last.pt holding an argparse.Namespace: loading it needs full (unsafe) unpickling.
    torch.save({"args": argparse.Namespace(lr=1.0)}, tmp_path / LAST_NAME)
    with pytest.raises(CheckpointError) as info:
        load_latest(tmp_path, log=lambda _: None)
    msg = str(info.value)
    assert f"{tmp_path / LAST_NAME}: holds Python objects other than tensors" in msg
    assert "weights_only=False" not in msg and "training.overwrite=true" in msg


def test_all_broken_raises_listing_every_file_and_validate_is_applied(tmp_path):
    assert load_latest(tmp_path / "missing") is None
    assert load_latest(tmp_path) is None
    save(state(1), tmp_path, 1)
    save(state(2), tmp_path, 2)

    def validate(s):
        if s["format"] != "kronos":
            raise ValueError("format 'test' is not a kronos training checkpoint")

    with pytest.raises(CheckpointError) as info:
        load_latest(tmp_path, validate=validate, log=lambda _: None)
    lines = str(info.value).splitlines()
    assert lines[1:3] == [f"  {tmp_path / 'step-00000002.pt'}: format 'test' is not a kronos training checkpoint",
                          f"  {tmp_path / 'step-00000001.pt'}: format 'test' is not a kronos training checkpoint"]
    assert isinstance(info.value, ValueError)


def test_legacy_last_pt_alone_is_loaded(tmp_path):
    torch.save(state(7), tmp_path / LAST_NAME)
    path, loaded = load_latest(tmp_path)
    assert path == tmp_path / LAST_NAME and loaded["step"] == 7


def test_non_finite_state_is_never_written(tmp_path):
    save(state(1), tmp_path, 1)
    bad = state(2)
    bad["model"]["w"][0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match="step-00000002.pt: tensor 'model.w'"):
        save(bad, tmp_path, 2)
    assert names(tmp_path) == [LAST_NAME, "step-00000001.pt"]


Usage = namedtuple("Usage", "total used free")


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    save(state(1), tmp_path, 1)
    monkeypatch.setattr(store.shutil, "disk_usage", lambda _: Usage(10**9, 10**9 - 1000, 1000))
    big = {"w": torch.zeros(1024, 1024)}  # 4 MiB
    with pytest.raises(CheckpointWriteError) as info:
        save(big, tmp_path, 2)
    e = info.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename == str(tmp_path / "step-00000002.pt")
    assert "1000 B free on that disk, about 4.1 MiB needed" in str(e)
    assert names(tmp_path) == [LAST_NAME, "step-00000001.pt"]


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EFBIG, "File too large"),
    RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: "
                 "file write failed"),
])
def test_a_disk_full_write_becomes_a_clear_oserror_and_leaves_nothing_behind(tmp_path, monkeypatch, error):
    save(state(1), tmp_path, 1)
    real_save = torch.save

    def failing_save(obj, f):
        real_save({"partial": torch.zeros(10)}, f)  # some bytes reach the temporary file first
        raise error

    monkeypatch.setattr(store.torch, "save", failing_save)
    with pytest.raises(CheckpointWriteError) as info:
        save(state(2), tmp_path, 2)
    msg = str(info.value)
    assert msg.startswith(f"cannot write checkpoint {tmp_path / 'step-00000002.pt'}: ")
    assert "free on that disk, about 64.1 KiB needed" in msg and "training.output_dir" in msg
    assert "inline_container" not in msg
    assert names(tmp_path) == [LAST_NAME, "step-00000001.pt"]  # no temp file, the old checkpoint intact
    assert load_latest(tmp_path)[1]["step"] == 1


def test_a_real_file_size_limit_gives_the_clear_error(tmp_path):
    # RLIMIT_FSIZE makes the kernel answer EFBIG, exactly as a full disk answers ENOSPC, through torch's writer.
    save(state(1), tmp_path, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
    try:
        with pytest.raises(CheckpointWriteError, match="step-00000002.pt: file too large; .* about 3.9 MiB needed"):
            save({"w": torch.zeros(1_000_000)}, tmp_path, 2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert names(tmp_path) == [LAST_NAME, "step-00000001.pt"]


def test_other_write_errors_propagate_and_clean_up(tmp_path, monkeypatch):
    def interrupted(obj, f):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(state(1), tmp_path, 1)
    assert names(tmp_path) == []


def test_orphans_of_killed_writes_are_removed_and_nothing_else(tmp_path):
    save(state(1), tmp_path, 1)
    (tmp_path / ".step-00000002.pt.abc123.tmp").write_bytes(b"half")
    (tmp_path / ".last.pt.deadbeef.tmp").write_bytes(b"x")
    (tmp_path / ".cache.tmp").mkdir()
    model_tmp = tmp_path / ".best_model.k2j4_x9a"  # save_pretrained_atomic's mkdtemp folder
    model_tmp.mkdir()
    (model_tmp / "config.json").write_text("{}")
    (model_tmp / "model.safetensors").write_bytes(b"x")
    (tmp_path / ".best_model.old").mkdir()
    keep = [tmp_path / ".git", tmp_path / ".hidden_user.abcdefgh", tmp_path / "notes.tmp", tmp_path / ".tmp"]
    keep[0].mkdir()
    keep[1].mkdir()
    (keep[1] / "data.csv").write_text("a")
    keep[2].write_text("user file")
    keep[3].write_text("x")
    lines: list[str] = []
    removed = prepare_folder(tmp_path, log=lines.append)
    assert sorted(p.name for p in removed) == [".best_model.k2j4_x9a", ".best_model.old", ".cache.tmp",
                                               ".last.pt.deadbeef.tmp", ".step-00000002.pt.abc123.tmp"]
    assert names(tmp_path) == sorted([".git", ".hidden_user.abcdefgh", ".tmp", LAST_NAME, "notes.tmp",
                                      "step-00000001.pt"])
    assert len(lines) == 1 and "removed 5 leftover(s)" in lines[0]
    assert remove_orphans(tmp_path) == []
    assert prepare_folder(tmp_path / "new" / "checkpoints") == [] and (tmp_path / "new" / "checkpoints").is_dir()


def test_list_checkpoints_orders_by_step_beyond_eight_digits(tmp_path):
    for step in (5, 123456789, 99999999):
        (tmp_path / f"step-{step:08d}.pt").write_bytes(b"x")
    (tmp_path / "step-12.pt").write_bytes(b"x")  # not ours: fewer than 8 digits
    assert [s for s, _ in list_checkpoints(tmp_path)] == [123456789, 99999999, 5]
    shutil.rmtree(tmp_path)
    assert list_checkpoints(tmp_path) == []
