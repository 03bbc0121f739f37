"""Checkpoint files: atomic writes, the last/best/epoch layout, resume paths, safe loads, the folder's lock."""

from __future__ import annotations

import io
import os
import shlex
import signal
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import assert_names

from imagenet_elastic.atomic_files import atomic_write_bytes
from imagenet_elastic.checkpoint.store import CheckpointFolder, CheckpointLock, check_writable, load
from imagenet_elastic.errors import UserError, first_line


def fake_state(epoch: int) -> dict:
    return {"model": {"w": torch.full((2,), float(epoch))}, "epoch": epoch}


def serialize(state: dict) -> bytes:
    """A checkpoint's bytes, for files written by hand."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def saved_epoch(path) -> int:
    return load(str(path))["epoch"]


# ----------------------------------------------------------------------------- CheckpointFolder.save

def test_save_writes_last_and_epoch_file_and_best_only_when_best(tmp_path):
    manager = CheckpointFolder(str(tmp_path), keep=3)
    manager.save(fake_state(1), 1, is_best=True)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "epoch_0001.pt", "last.pt"]
    manager.save(fake_state(2), 2, is_best=False)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "epoch_0001.pt", "epoch_0002.pt", "last.pt"]
    assert saved_epoch(tmp_path / "last.pt") == 2
    assert saved_epoch(tmp_path / "best.pt") == 1
    assert saved_epoch(tmp_path / "epoch_0002.pt") == 2
    manager.save(fake_state(3), 3, is_best=True)
    assert saved_epoch(tmp_path / "best.pt") == 3


def test_save_without_best_never_writes_best(tmp_path):
    manager = CheckpointFolder(str(tmp_path), keep=2)
    for epoch in range(1, 4):
        manager.save(fake_state(epoch), epoch, is_best=False)
    assert "best.pt" not in os.listdir(tmp_path)


def test_save_keeps_only_the_newest_k_epoch_files(tmp_path):
    manager = CheckpointFolder(str(tmp_path), keep=2)
    for epoch in range(1, 6):
        manager.save(fake_state(epoch), epoch, is_best=False)
    assert sorted(os.listdir(tmp_path)) == ["epoch_0004.pt", "epoch_0005.pt", "last.pt"]
    assert manager.epoch_files() == [str(tmp_path / "epoch_0004.pt"), str(tmp_path / "epoch_0005.pt")]
    assert saved_epoch(tmp_path / "epoch_0004.pt") == 4
    assert manager.stale_temp_files() == []


def test_save_with_keep_zero_keeps_no_epoch_files(tmp_path):
    manager = CheckpointFolder(str(tmp_path), keep=0)
    (tmp_path / "epoch_0001.pt").write_bytes(serialize(fake_state(1)))  # left by an earlier run
    for epoch in range(2, 4):
        manager.save(fake_state(epoch), epoch, is_best=epoch == 2)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "last.pt"]
    assert saved_epoch(tmp_path / "last.pt") == 3


def test_prune_leaves_other_files_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "epoch_12.pt").write_text("not matched: fewer than 4 digits")
    manager = CheckpointFolder(str(tmp_path), keep=1)
    for epoch in range(1, 3):
        manager.save(fake_state(epoch), epoch, is_best=False)
    assert sorted(os.listdir(tmp_path)) == ["epoch_0002.pt", "epoch_12.pt", "last.pt", "notes.txt"]


# ----------------------------------------------------------------------------- resume_path

def test_resume_path_none_is_a_fresh_start_in_an_empty_folder(tmp_path):
    assert CheckpointFolder(str(tmp_path), 3).resume_path(None, restarted=False) is None


def test_resume_path_auto_without_last_is_a_fresh_start(tmp_path):
    assert CheckpointFolder(str(tmp_path), 3).resume_path("auto", restarted=False) is None


def test_resume_path_auto_with_last_continues_from_last(tmp_path):
    manager = CheckpointFolder(str(tmp_path), 3)
    manager.save(fake_state(1), 1, is_best=False)
    assert manager.resume_path("auto", restarted=False) == str(tmp_path / "last.pt")


def two_epochs_saved(folder) -> CheckpointFolder:
    manager = CheckpointFolder(str(folder), 3)
    manager.save(fake_state(1), 1, is_best=False)
    manager.save(fake_state(2), 2, is_best=False)
    return manager


def test_resume_path_explicit_existing_file_is_used(tmp_path):
    manager = two_epochs_saved(tmp_path)
    chosen = str(tmp_path / "epoch_0001.pt")
    assert manager.resume_path(chosen, restarted=False) == chosen


def test_resume_path_explicit_missing_file_raises_user_error_naming_it(tmp_path):
    missing = str(tmp_path / "gone.pt")
    with pytest.raises(UserError, match="no such checkpoint file") as caught:
        CheckpointFolder(str(tmp_path), 3).resume_path(missing, restarted=False)
    assert f"--resume {missing}" in str(caught.value)


def test_fresh_start_over_an_existing_last_raises_user_error_mentioning_resume(tmp_path):
    manager = CheckpointFolder(str(tmp_path), 3)
    manager.save(fake_state(1), 1, is_best=False)
    with pytest.raises(UserError, match="--resume") as caught:
        manager.resume_path(None, restarted=False)
    assert str(tmp_path / "last.pt") in str(caught.value)
    assert "--checkpoints-path" in str(caught.value)


def test_a_lock_file_that_cannot_be_opened_is_named(tmp_path):
    (tmp_path / ".lock").mkdir()  # a folder where the lock file goes
    with pytest.raises(UserError) as caught:
        CheckpointLock(str(tmp_path)).acquire(0, print)
    assert str(tmp_path / ".lock") in str(caught.value)


@pytest.mark.parametrize("name", ["last.pt", "best.pt", "epoch_0002.pt", "config.yaml"])
def test_a_folder_where_a_save_renames_a_file_is_named(tmp_path, name):
    (tmp_path / name).mkdir()
    with pytest.raises(UserError) as caught:
        check_writable(str(tmp_path), ["config.yaml"])
    assert str(tmp_path / name) in str(caught.value)


def test_links_to_folders_and_other_names_pass(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "config.yaml")  # a save's rename replaces the link
    (tmp_path / "tensorboard").mkdir()
    check_writable(str(tmp_path), ["config.yaml"])


def test_a_damaged_best_is_said_by_its_zip_directory_and_a_sound_one_is_not(tmp_path):
    warnings: list[str] = []
    manager = CheckpointFolder(str(tmp_path), 3, warnings.append)
    manager.save(fake_state(1), 1, is_best=True)
    manager.check_best()
    assert warnings == [] and manager.readable(["best.pt"]) == str(tmp_path / "best.pt")
    data = (tmp_path / "best.pt").read_bytes()
    (tmp_path / "best.pt").unlink()
    (tmp_path / "best.pt").write_bytes(data[:-100])  # the end cut off: no zip directory
    manager.check_best()
    assert len(warnings) == 1 and warnings[0].startswith(str(tmp_path / "best.pt"))
    assert manager.readable(["best.pt", "epoch_0001.pt"]) == str(tmp_path / "epoch_0001.pt")


def run_folder(folder, run_id) -> CheckpointFolder:
    os.makedirs(folder, exist_ok=True)
    manager = CheckpointFolder(str(folder), 3)
    manager.save({**fake_state(1), "run_id": run_id}, 1, is_best=False)
    return manager


def test_a_checkpoint_from_elsewhere_may_not_continue_in_a_folder_of_another_run(tmp_path):
    manager = run_folder(tmp_path / "here", "this-run")
    with pytest.raises(UserError, match="--checkpoints-path") as caught:
        manager.check_same_run(str(tmp_path / "elsewhere.pt"), "another-run")
    assert str(tmp_path / "here") in str(caught.value)


@pytest.mark.parametrize(("saved", "resumed"), [(None, "this-run"), ("this-run", None), (None, None)])
def test_a_side_written_before_checkpoints_named_their_run_continues_with_a_warning(tmp_path, saved, resumed):
    os.makedirs(tmp_path / "here")
    warnings: list[str] = []
    manager = CheckpointFolder(str(tmp_path / "here"), 3, warnings.append)
    manager.save({**fake_state(1), **({"run_id": saved} if saved else {})}, 1, is_best=False)
    assert manager.check_same_run(str(tmp_path / "backup.pt"), resumed)
    assert len(warnings) == 1 and str(tmp_path / "here" / "last.pt") in warnings[0]


def test_a_damaged_last_pt_does_not_stop_a_backup_from_continuing_with_a_warning(tmp_path):
    warnings: list[str] = []
    manager = run_folder(tmp_path / "here", "this-run")
    manager.warn = warnings.append
    (tmp_path / "here" / "last.pt").write_bytes(b"not a checkpoint")
    assert manager.check_same_run(str(tmp_path / "backup.pt"), "this-run")
    assert len(warnings) == 1 and str(tmp_path / "here" / "last.pt") in warnings[0]


def test_the_same_runs_checkpoint_from_elsewhere_continues_it_in_its_folder(tmp_path):
    assert run_folder(tmp_path / "here", "this-run").check_same_run(str(tmp_path / "backup.pt"), "this-run")


def test_a_checkpoint_of_the_folders_run_may_roll_it_back(tmp_path):
    manager = run_folder(tmp_path, "this-run")
    assert manager.check_same_run(str(tmp_path / "." / "epoch_0001.pt"), "this-run")
    (tmp_path / "copy.pt").write_bytes(serialize({**fake_state(0), "run_id": "this-run"}))
    assert manager.check_same_run(str(tmp_path / "copy.pt"), "this-run")


def test_another_runs_checkpoint_copied_into_the_folder_is_refused_as_one_from_elsewhere(tmp_path):
    manager = run_folder(tmp_path, "this-run")
    (tmp_path / "other.pt").write_bytes(serialize({**fake_state(5), "run_id": "another-run"}))
    with pytest.raises(UserError, match="--checkpoints-path") as caught:
        manager.check_same_run(str(tmp_path / "other.pt"), "another-run")
    assert str(tmp_path / "other.pt") in str(caught.value)
    assert load(str(tmp_path / "last.pt"))["run_id"] == "this-run"


def test_a_checkpoint_of_a_folder_without_last_continues_its_run_there(tmp_path):
    run_folder(tmp_path, "this-run")
    os.remove(tmp_path / "last.pt")  # removed by hand: resume_path names the newest epoch_NNNN.pt to continue from
    assert CheckpointFolder(str(tmp_path), 3).check_same_run(str(tmp_path / "epoch_0001.pt"), "this-run")


def test_any_checkpoint_may_continue_in_a_folder_without_last_as_a_fork(tmp_path):
    os.makedirs(tmp_path / "empty")
    assert not CheckpointFolder(str(tmp_path / "empty"), 3).check_same_run(str(tmp_path / "elsewhere.pt"), "a-run")


def test_restarted_round_continues_from_last_whatever_resume_says(tmp_path):
    manager = two_epochs_saved(tmp_path)
    last = str(tmp_path / "last.pt")
    assert manager.resume_path(None, restarted=True) == last
    assert manager.resume_path("auto", restarted=True) == last
    assert manager.resume_path(str(tmp_path / "epoch_0001.pt"), restarted=True) == last


def test_restarted_round_without_last_follows_resume(tmp_path):
    manager = CheckpointFolder(str(tmp_path), 3)
    assert manager.resume_path(None, restarted=True) is None
    with pytest.raises(UserError):
        manager.resume_path(str(tmp_path / "gone.pt"), restarted=True)


# ----------------------------------------------------------------------------- load

def test_load_of_a_valid_checkpoint_returns_its_dict(tmp_path):
    path = tmp_path / "ok.pt"
    atomic_write_bytes(serialize(fake_state(4)), str(path))
    state = load(str(path))
    assert state["epoch"] == 4
    assert torch.equal(state["model"]["w"], torch.full((2,), 4.0))


def test_load_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(UserError, match="does not exist") as caught:
        load(str(tmp_path / "none.pt"))
    assert str(tmp_path / "none.pt") in str(caught.value)


def test_load_of_a_truncated_checkpoint_raises_user_error_naming_the_path(tmp_path):
    data = serialize(fake_state(1))
    path = tmp_path / "cut.pt"
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(UserError, match="damaged or not a checkpoint") as caught:
        load(str(path))
    assert str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_load_of_a_non_checkpoint_file_raises_user_error_naming_the_path(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("these are my notes, not a checkpoint\n" * 20)
    with pytest.raises(UserError) as caught:
        load(str(path))
    assert str(path) in str(caught.value)


def damaged_pickle(path) -> None:
    """A zip archive as torch.save writes one, whose pickle asks for memo 101: torch raises `KeyError: 101`."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02h\x65.")
        archive.writestr("archive/version", b"3\n")


@pytest.mark.parametrize("how", ["text", "empty", "cut short", "another zip", "damaged pickle"])
@pytest.mark.parametrize("lazy", [False, True])
def test_load_of_a_damaged_file_names_it_in_its_own_words_not_torchs(tmp_path, how, lazy):
    path = tmp_path / "last.pt"
    data = serialize(fake_state(1))
    if how == "damaged pickle":
        damaged_pickle(path)
    elif how == "another zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes.txt", "not a checkpoint")
    else:
        path.write_bytes({"text": b"these are my notes\n" * 20, "empty": b"", "cut short": data[:len(data) // 2]}[how])
    with pytest.raises(Exception) as torch_says:
        torch.load(path, weights_only=True, mmap=lazy)
    with pytest.raises(UserError, match="damaged or not a checkpoint") as caught:
        load(str(path), lazy)
    message = str(caught.value).replace(str(path), "PATH")
    assert message.startswith("checkpoint PATH ") and "\n" not in message
    # not `(101)`, `(EOFError)`, `(pop from empty list)` or torch's advice
    assert first_line(torch_says.value).replace(str(path), "PATH")[:40] not in message


def test_load_of_a_torch_file_without_checkpoint_keys_raises_user_error(tmp_path):
    path = tmp_path / "tensor.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(UserError, match="is not an imagenet_elastic checkpoint") as caught:
        load(str(path))
    assert str(path) in str(caught.value)


# ----------------------------------------------------------------------------- CheckpointLock held by another process

LOCK_HOLDER = r"""
import sys, time
from imagenet_elastic.checkpoint.store import CheckpointLock
lock = CheckpointLock(sys.argv[1])
lock.acquire(0, print)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def hold_lock(folder, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(folder), str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
def test_second_writer_is_refused_with_the_holder_named(tmp_path):
    holder = hold_lock(tmp_path, 30)
    try:
        waits = []
        expected = rf"checkpoints path {tmp_path} is in use by another run \(pid {holder.pid}"
        with pytest.raises(UserError, match=expected):
            CheckpointLock(str(tmp_path)).acquire(0.5, waits.append)
        assert waits and f"pid {holder.pid}" in waits[0]
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_lock_of_a_killed_holder_is_free_again(tmp_path):
    holder = hold_lock(tmp_path, 30)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = CheckpointLock(str(tmp_path))
    lock.acquire(5, lambda _: None)
    assert f"pid {os.getpid()}" in (tmp_path / ".lock").read_text()
    lock.release()


HOLDER_WITH_A_CHILD = r"""
import multiprocessing, subprocess, sys, time
from imagenet_elastic.checkpoint.store import CheckpointLock
lock = CheckpointLock(sys.argv[1])
lock.acquire(0, print)
if sys.argv[2] == "forked":  # as a loader worker is
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
    child.start()
    pid = child.pid
else:  # a child that keeps the lock's descriptor, as forked loader workers did
    pid = subprocess.Popen(["sleep", "30"], pass_fds=[lock.fd]).pid
print(pid, flush=True)
time.sleep(30)
"""


def killed_holder_and_its_child(folder, how: str) -> int:
    """A lock holder that started a child (`how`), killed with SIGKILL: the child's pid, the child still alive."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER_WITH_A_CHILD, str(folder), how], stdout=subprocess.PIPE,
                              text=True)
    child = int(holder.stdout.readline())
    holder.kill()
    holder.wait()
    assert os.path.exists(f"/proc/{child}")
    return child


@pytest.mark.slow
def test_the_lock_is_free_once_its_holder_is_killed_though_its_forked_children_live_on(tmp_path):
    child = killed_holder_and_its_child(tmp_path, "forked")
    try:
        lock = CheckpointLock(str(tmp_path))
        lock.acquire(0, lambda _: None)  # no wait: the loader workers of a `kill -9`ed run do not hold the folder
        assert os.path.exists(f"/proc/{child}")
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_a_lock_whose_holder_has_ended_names_the_processes_that_still_hold_it(tmp_path):
    child = killed_holder_and_its_child(tmp_path, "kept")
    try:
        waits = []
        with pytest.raises(UserError) as caught:
            CheckpointLock(str(tmp_path)).acquire(0.5, waits.append)
        assert "which has ended" in waits[0] and f"but pid {child} still hold the lock" in str(caught.value)
        assert f"kill {child}" in str(caught.value)
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_waiting_writer_gets_the_lock_when_the_holder_ends(tmp_path):
    holder = hold_lock(tmp_path, 1.0)
    lock = CheckpointLock(str(tmp_path))
    lock.acquire(20, lambda _: None)
    assert holder.wait(timeout=5) == 0
    lock.release()


@pytest.mark.parametrize("resume", [None, "auto"])
@pytest.mark.parametrize("left", [["epoch_0001.pt", "epoch_0002.pt", "best.pt"], ["best.pt"]])
def test_a_folder_of_an_earlier_runs_checkpoints_without_last_is_refused_naming_the_newest(tmp_path, resume, left):
    manager = two_epochs_saved(tmp_path)
    manager.save(fake_state(2), None, is_best=True)
    for name in set(os.listdir(tmp_path)) - set(left):
        os.remove(tmp_path / name)  # last.pt removed by hand (damaged?), or only best.pt copied here
    with pytest.raises(UserError) as caught:
        manager.resume_path(resume, restarted=False)
    newest = "epoch_0002.pt" if len(left) > 1 else "best.pt"
    assert_names(str(caught.value), tmp_path, "last.pt", f"--resume {tmp_path / newest}")


def test_the_resume_suggested_for_a_folder_without_last_pastes_back_as_its_path(tmp_path):
    folder = tmp_path / "my run's $HOME"  # a space, a quote and a $: the shell would split or expand it bare
    folder.mkdir()
    manager = two_epochs_saved(folder)
    os.remove(folder / "last.pt")
    with pytest.raises(UserError) as caught:
        manager.resume_path(None, restarted=False)
    suggested = str(caught.value).split(": ", 1)[1].split(" continues from the newest")[0]
    assert shlex.split(suggested) == ["--resume", str(folder / "epoch_0002.pt")], suggested
