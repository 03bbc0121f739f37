"""One write per save: epoch_NNNN.pt and best.pt are hard links to the file committed as last.pt."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from imagenet_elastic.checkpoint import store
from imagenet_elastic.checkpoint.store import CheckpointFolder, load
from imagenet_elastic.errors import StorageError


def state(version: int) -> dict:
    return {"model": {"w": torch.full((1000,), float(version))}, "epoch": version}


def version(path) -> int:
    return load(str(path))["epoch"]


def count_writes(monkeypatch) -> list[str]:
    """Every file a save serializes a state into."""
    written = []
    real = store.save_to

    def counting(state, file):
        written.append(file.name)
        real(state, file)

    monkeypatch.setattr(store, "save_to", counting)
    return written


def test_an_epoch_end_save_that_is_best_writes_once_and_links_three_names(tmp_path, monkeypatch):
    writes = count_writes(monkeypatch)
    CheckpointFolder(str(tmp_path), keep=3).save(state(1), 1, is_best=True)
    assert len(writes) == 1
    names = [tmp_path / n for n in ("last.pt", "epoch_0001.pt", "best.pt")]
    assert {os.stat(p).st_ino for p in names} == {os.stat(names[0]).st_ino}
    assert os.stat(names[0]).st_nlink == 3
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "epoch_0001.pt", "last.pt"]


def test_a_new_last_pt_is_a_new_file_so_older_names_keep_their_contents(tmp_path):
    manager = CheckpointFolder(str(tmp_path), keep=3)
    manager.save(state(1), 1, is_best=True)
    manager.save(state(2), 2, is_best=False)
    manager.save(state(3), None)  # mid-epoch: last.pt alone
    assert (version(tmp_path / "last.pt"), version(tmp_path / "epoch_0002.pt"), version(tmp_path / "best.pt"),
            version(tmp_path / "epoch_0001.pt")) == (3, 2, 1, 1)
    assert os.path.samefile(tmp_path / "best.pt", tmp_path / "epoch_0001.pt")
    assert not os.path.samefile(tmp_path / "last.pt", tmp_path / "epoch_0002.pt")


def test_pruning_an_epoch_file_keeps_best_pt_that_shares_it(tmp_path):
    manager = CheckpointFolder(str(tmp_path), keep=1)
    manager.save(state(1), 1, is_best=True)
    manager.save(state(2), 2, is_best=False)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "epoch_0002.pt", "last.pt"]
    assert version(tmp_path / "best.pt") == 1 and os.stat(tmp_path / "best.pt").st_nlink == 1


@pytest.mark.parametrize("refusal", [errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK])
def test_a_file_system_without_hard_links_gets_copies_and_one_warning(tmp_path, monkeypatch, refusal):
    def no_links(src, dst):
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(store.os, "link", no_links)
    warnings: list[str] = []
    manager = CheckpointFolder(str(tmp_path), keep=3, warn=warnings.append)
    manager.save(state(1), 1, is_best=True)
    manager.save(state(2), 2, is_best=True)
    assert len(warnings) == 1 and "does not allow hard links" in warnings[0] and str(tmp_path) in warnings[0]
    for name, expected in (("last.pt", 2), ("epoch_0002.pt", 2), ("best.pt", 2), ("epoch_0001.pt", 1)):
        assert version(tmp_path / name) == expected
    assert (tmp_path / "last.pt").read_bytes() == (tmp_path / "best.pt").read_bytes()
    assert not os.path.samefile(tmp_path / "last.pt", tmp_path / "best.pt")
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "epoch_0001.pt", "epoch_0002.pt", "last.pt"]


def test_a_link_that_fails_for_another_reason_is_a_storage_error_and_nothing_changes(tmp_path, monkeypatch):
    manager = CheckpointFolder(str(tmp_path), keep=3)
    manager.save(state(1), 1, is_best=True)
    before = sorted(os.listdir(tmp_path))

    def broken(src, dst):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(store.os, "link", broken)
    with pytest.raises(StorageError) as caught:
        manager.save(state(2), 2, is_best=False)
    assert str(caught.value) == (f"input/output error linking {tmp_path / 'epoch_0002.pt'}; "
                                 f"the previous checkpoint {tmp_path / 'last.pt'} is intact")
    assert caught.value.exit_code == 74
    assert sorted(os.listdir(tmp_path)) == before  # no temp file, no new name
    assert version(tmp_path / "last.pt") == 1


def test_a_failed_write_removes_its_temp_file_and_names_the_checkpoint_it_was_writing(tmp_path, monkeypatch):
    manager = CheckpointFolder(str(tmp_path), keep=3)

    def quota(state, file):
        file.write(b"partial")
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(store, "save_to", quota)
    with pytest.raises(StorageError, match=r"^disk quota exceeded writing .*last\.pt \(4 kB\)$"):
        manager.save(state(1), None)  # nothing before it: no "previous checkpoint" to speak of
    assert os.listdir(tmp_path) == []



@pytest.mark.parametrize("links", [True, False], ids=["just after the link", "at the copy's rename"])
def test_a_ctrl_c_while_an_epoch_file_is_named_leaves_no_temp_file_and_last_pt_as_it_was(tmp_path, monkeypatch,
                                                                                         links):
    """A second Ctrl-C stops a save at once: the temp file of an extra name (a link, or a copy) goes with it, or a
    checkpoint's worth of disk stays taken until the next start."""
    manager = CheckpointFolder(str(tmp_path), keep=3)
    manager.save(state(1), 1, is_best=True)
    manager.links = links
    real_link, real_replace = os.link, os.replace

    def link_then_interrupted(src, dst):
        real_link(src, dst)
        raise KeyboardInterrupt

    def interrupted_at_epoch_file(src, dst):
        if os.path.basename(dst) == "epoch_0002.pt":
            raise KeyboardInterrupt
        real_replace(src, dst)

    if links:
        monkeypatch.setattr(store.os, "link", link_then_interrupted)
    else:
        monkeypatch.setattr(store.os, "replace", interrupted_at_epoch_file)
    with pytest.raises(KeyboardInterrupt):
        manager.save(state(2), 2, is_best=False)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "epoch_0001.pt", "last.pt"]
    assert version(tmp_path / "last.pt") == 1
