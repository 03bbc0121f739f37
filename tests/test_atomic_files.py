"""Files that are complete or absent: atomic writes, their permissions, the umask read without a change."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

from imagenet_elastic import atomic_files
from imagenet_elastic.atomic_files import atomic_write_bytes
from imagenet_elastic.checkpoint.store import CheckpointFolder


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- atomic writes

def test_atomic_write_bytes_writes_the_data_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "file.bin"
    atomic_write_bytes(b"first", str(target))
    atomic_write_bytes(b"second", str(target))
    assert target.read_bytes() == b"second"
    assert os.listdir(tmp_path) == ["file.bin"]


def test_atomic_write_bytes_mode_respects_the_umask_not_0600(tmp_path):
    target = tmp_path / "file.bin"
    atomic_write_bytes(b"x", str(target))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o666 & ~current_umask()


def test_atomic_write_bytes_mode_follows_a_group_readable_umask(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic_files, "process_umask", lambda: 0o022)
    target = tmp_path / "file.bin"
    atomic_write_bytes(b"x", str(target))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


def test_atomic_write_bytes_failure_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch):
    target = tmp_path / "file.bin"
    atomic_write_bytes(b"old", str(target))

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_files.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(b"new", str(target))
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file.bin"]


def test_the_umask_is_read_without_being_changed():
    before = current_umask()
    assert atomic_files.process_umask() == before == current_umask()


def test_every_temp_file_is_made_beside_its_target_so_the_rename_never_crosses_file_systems(tmp_path, monkeypatch):
    """rename(2) cannot cross file systems (EXDEV): a temp file made in /tmp, a tmpfs on most clusters, would make
    every save over a network file system fail. Here a rename between folders fails as it would across mounts."""
    real_replace = os.replace

    def replace_within_one_folder(source, target):
        if os.path.dirname(os.path.abspath(source)) != os.path.dirname(os.path.abspath(target)):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(source))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace_within_one_folder)
    atomic_write_bytes(b"data", str(tmp_path / "metrics.jsonl"))
    manager = CheckpointFolder(str(tmp_path / "ckpt"), keep=2)
    os.makedirs(manager.folder)
    manager.save({"model": {"w": torch.ones(3)}, "epoch": 1}, epoch=1, is_best=True)
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"data"
    assert sorted(os.listdir(manager.folder)) == ["best.pt", "epoch_0001.pt", "last.pt"]
