"""The background writer's ordering rules, with real files and a write held open by a gate."""

from __future__ import annotations

import errno
import os
import signal
import threading

import pytest
import torch

from imagenet_elastic.checkpoint import store
from imagenet_elastic.checkpoint.saving import CheckpointWriter, HostCopy
from imagenet_elastic.checkpoint.store import CheckpointFolder, load
from imagenet_elastic.errors import StorageError

CPU = torch.device("cpu")


class GatedWrites:
    """Holds every checkpoint write at its start until released, and says when one is held."""

    def __init__(self, monkeypatch) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        real = store.save_to

        def gated(state, file):
            self.started.release()
            assert self.release.wait(30), "the test never released the write"
            real(state, file)

        monkeypatch.setattr(store, "save_to", gated)

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=30), "no write started"


def live_state(value: float) -> dict:
    return {"model": {"w": torch.full((1000,), value)}, "epoch": 0, "history": [{"epoch": 1}]}


def saved(path) -> dict:
    return load(str(path))


def test_submit_returns_while_the_write_is_held_and_wait_returns_once_it_is_on_disk(tmp_path, monkeypatch):
    gate = GatedWrites(monkeypatch)
    writer = CheckpointWriter(CheckpointFolder(str(tmp_path), keep=2), background=True, device=CPU)
    writer.submit(live_state(1.0), epoch=1, is_best=False)  # returns: the write is held
    gate.wait_started()
    assert not (tmp_path / "last.pt").exists()
    gate.release.set()
    assert writer.wait() is None
    assert saved(tmp_path / "last.pt")["model"]["w"][0] == 1.0 and (tmp_path / "epoch_0001.pt").exists()


def test_the_file_holds_the_state_as_it_was_at_submit_not_as_training_changed_it(tmp_path, monkeypatch):
    gate = GatedWrites(monkeypatch)
    writer = CheckpointWriter(CheckpointFolder(str(tmp_path), keep=0), background=True, device=CPU)
    state = live_state(1.0)
    writer.submit(state, epoch=None, is_best=False)
    gate.wait_started()
    state["model"]["w"].add_(5.0)  # the optimizer steps on while the write is in flight
    state["history"].append({"epoch": 2})
    gate.release.set()
    writer.wait()
    on_disk = saved(tmp_path / "last.pt")
    assert torch.equal(on_disk["model"]["w"], torch.full((1000,), 1.0)) and on_disk["history"] == [{"epoch": 1}]


def test_a_new_save_waits_for_the_one_in_flight_and_both_land_in_order(tmp_path, monkeypatch):
    gate = GatedWrites(monkeypatch)
    committed = []
    writer = CheckpointWriter(CheckpointFolder(str(tmp_path), keep=3), background=True, device=CPU)
    writer.submit(live_state(1.0), 1, False, after=lambda: committed.append(1))
    gate.wait_started()
    second = threading.Thread(target=writer.submit, args=(live_state(2.0), 2, False),
                              kwargs={"after": lambda: committed.append(2)})
    second.start()
    second.join(0.3)
    assert second.is_alive(), "a second save started while the first was in flight"
    gate.release.set()
    second.join(30)
    writer.wait()
    assert committed == [1, 2]
    assert saved(tmp_path / "last.pt")["model"]["w"][0] == 2.0 and saved(tmp_path / "epoch_0001.pt")["epoch"] == 0


def test_the_host_copy_reuses_its_buffers_so_the_run_holds_one_extra_copy():
    host = HostCopy(pin=False)
    state = live_state(1.0)
    first = host.copy(state)["model"]["w"]
    state["model"]["w"].fill_(2.0)
    second = host.copy(state)["model"]["w"]
    assert second.data_ptr() == first.data_ptr() != state["model"]["w"].data_ptr()
    assert second[0] == 2.0
    host.copy({"model": {"w": torch.zeros(10)}})  # another shape: a new buffer, the old one let go
    assert [b.numel() for b in host.buffers.values()] == [10]


def test_the_host_copy_keeps_channels_last_strides():
    weight = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)
    copied = HostCopy(pin=False).copy({"w": weight})["w"]
    assert copied.stride() == weight.stride() and torch.equal(copied, weight)


def test_a_failed_background_write_is_kept_for_the_training_thread_and_stops_further_writes(tmp_path, monkeypatch):
    def full(state, file):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store, "save_to", full)
    after = []
    writer = CheckpointWriter(CheckpointFolder(str(tmp_path), keep=3), background=True, device=CPU)
    writer.submit(live_state(1.0), 1, False, after=lambda: after.append(1))
    assert isinstance(writer.wait(), StorageError) and writer.failed
    writer.submit(live_state(2.0), 2, False)  # nothing more is written after a failure
    assert os.listdir(tmp_path) == [] and after == []
    error = writer.take_error()
    assert str(error).startswith(f"no space left on device writing {tmp_path / 'epoch_0001.pt'} (4 kB)")
    assert not writer.failed


def test_a_bug_in_the_writer_is_not_disguised_as_a_storage_error(tmp_path, monkeypatch):
    def bug(state, file):
        raise KeyError("oops")

    monkeypatch.setattr(store, "save_to", bug)
    writer = CheckpointWriter(CheckpointFolder(str(tmp_path), keep=3), background=True, device=CPU)
    writer.submit(live_state(1.0), 1, False)
    assert isinstance(writer.wait(), KeyError)


def test_a_ctrl_c_between_the_writers_making_and_its_start_leaves_close_nothing_to_wait_for(tmp_path, monkeypatch):
    """The second Ctrl-C raises wherever the training thread is: here inside submit, after the writer thread was made
    and before it started. Closing then ends without an error (the save never began), and the last file is kept."""
    writer = CheckpointWriter(CheckpointFolder(str(tmp_path), keep=0), background=False, device=CPU)
    writer.submit({"step": 1, "epoch": 0, "model": {"x": torch.ones(2)}}, epoch=None, is_best=False)  # on disk
    writer = CheckpointWriter(CheckpointFolder(str(tmp_path), keep=0), background=True, device=CPU)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        writer.submit({"step": 2, "epoch": 0, "model": {"x": torch.zeros(2)}}, epoch=None, is_best=False)
    assert writer.close() is None
    assert load(str(tmp_path / "last.pt"))["step"] == 1


def test_a_ctrl_c_during_a_wait_leaves_the_write_going_and_the_next_wait_waits_for_it(tmp_path, monkeypatch):
    """A Thread.join that a signal interrupted takes the thread for ended (CPython gh-90882): a wait after it would
    return before the file is on disk, and a process exiting then would lose the write."""
    gate = GatedWrites(monkeypatch)
    writer = CheckpointWriter(CheckpointFolder(str(tmp_path), keep=0), background=True, device=CPU)
    writer.submit(live_state(1.0), epoch=None, is_best=False)
    gate.wait_started()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            writer.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert writer.writing and writer.on_disk is None
    threading.Timer(0.3, gate.release.set).start()
    assert writer.wait() is None and not writer.writing
    assert writer.on_disk is not None and saved(tmp_path / "last.pt")["model"]["w"][0] == 1.0


def test_a_synchronous_writer_has_the_file_on_disk_when_submit_returns(tmp_path):
    writer = CheckpointWriter(CheckpointFolder(str(tmp_path), keep=3), background=False, device=CPU)
    writer.submit(live_state(3.0), 1, True)
    assert writer.thread is None and saved(tmp_path / "best.pt")["model"]["w"][0] == 3.0


@pytest.mark.cuda  # gpu_checks.sh's tests part runs it
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_host_copy_of_a_cuda_state_is_pinned_and_complete():
    state = {"w": torch.arange(1 << 20, device="cuda", dtype=torch.float32)}
    host = HostCopy(pin=True)
    copied = host.copy(state)["w"]
    host.wait_copied()
    assert copied.is_pinned() and copied.device.type == "cpu" and torch.equal(copied, state["w"].cpu())
