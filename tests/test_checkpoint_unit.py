"""Checkpoint files and the training state they hold, without running any training."""

from __future__ import annotations

import io
import os
import random
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest
import timm  # the package imports timm lazily; importing it here keeps its ~2 s out of the tests' timings
import torch

from imagenet_elastic import checkpoint
from imagenet_elastic.checkpoint import CheckpointLock, CheckpointManager, atomic_write_bytes, load, serialize
from imagenet_elastic.errors import UserError
from imagenet_elastic.model import create_model, create_optimizer
from imagenet_elastic.state import TrainState, check_compatible

CLASSES = ("ant", "bee", "cat")


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fake_state(epoch: int) -> dict:
    return {"model": {"w": torch.full((2,), float(epoch))}, "epoch": epoch}


def saved_epoch(path) -> int:
    return load(str(path))["epoch"]


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
    monkeypatch.setattr(checkpoint, "_UMASK", 0o022)
    target = tmp_path / "file.bin"
    atomic_write_bytes(b"x", str(target))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


def test_atomic_write_bytes_failure_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch):
    target = tmp_path / "file.bin"
    atomic_write_bytes(b"old", str(target))

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(b"new", str(target))
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file.bin"]


# ----------------------------------------------------------------------------- CheckpointManager.save

def test_save_writes_last_and_epoch_file_and_best_only_when_best(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep=3)
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
    manager = CheckpointManager(str(tmp_path), keep=2)
    for epoch in range(1, 4):
        manager.save(fake_state(epoch), epoch, is_best=False)
    assert "best.pt" not in os.listdir(tmp_path)


def test_save_keeps_only_the_newest_k_epoch_files(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep=2)
    for epoch in range(1, 6):
        manager.save(fake_state(epoch), epoch, is_best=False)
    assert sorted(os.listdir(tmp_path)) == ["epoch_0004.pt", "epoch_0005.pt", "last.pt"]
    assert manager.epoch_files() == [str(tmp_path / "epoch_0004.pt"), str(tmp_path / "epoch_0005.pt")]
    assert saved_epoch(tmp_path / "epoch_0004.pt") == 4
    assert manager.stale_temp_files() == []


def test_save_with_keep_zero_keeps_no_epoch_files(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep=0)
    (tmp_path / "epoch_0001.pt").write_bytes(serialize(fake_state(1)))  # left by an earlier run
    for epoch in range(2, 4):
        manager.save(fake_state(epoch), epoch, is_best=epoch == 2)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "last.pt"]
    assert saved_epoch(tmp_path / "last.pt") == 3


def test_prune_leaves_other_files_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "epoch_12.pt").write_text("not matched: fewer than 4 digits")
    manager = CheckpointManager(str(tmp_path), keep=1)
    for epoch in range(1, 3):
        manager.save(fake_state(epoch), epoch, is_best=False)
    assert sorted(os.listdir(tmp_path)) == ["epoch_0002.pt", "epoch_12.pt", "last.pt", "notes.txt"]


# ----------------------------------------------------------------------------- resume_path

def test_resume_path_none_is_a_fresh_start_in_an_empty_folder(tmp_path):
    assert CheckpointManager(str(tmp_path), 3).resume_path(None, restarted=False) is None


def test_resume_path_auto_without_last_is_a_fresh_start(tmp_path):
    assert CheckpointManager(str(tmp_path), 3).resume_path("auto", restarted=False) is None


def test_resume_path_auto_with_last_continues_from_last(tmp_path):
    manager = CheckpointManager(str(tmp_path), 3)
    manager.save(fake_state(1), 1, is_best=False)
    assert manager.resume_path("auto", restarted=False) == str(tmp_path / "last.pt")


def test_resume_path_explicit_existing_file_is_used(tmp_path):
    manager = CheckpointManager(str(tmp_path), 3)
    manager.save(fake_state(1), 1, is_best=False)
    manager.save(fake_state(2), 2, is_best=False)
    chosen = str(tmp_path / "epoch_0001.pt")
    assert manager.resume_path(chosen, restarted=False) == chosen


def test_resume_path_explicit_missing_file_raises_user_error_naming_it(tmp_path):
    missing = str(tmp_path / "gone.pt")
    with pytest.raises(UserError, match="no such checkpoint file") as caught:
        CheckpointManager(str(tmp_path), 3).resume_path(missing, restarted=False)
    assert f"--resume {missing}" in str(caught.value)


def test_fresh_start_over_an_existing_last_raises_user_error_mentioning_resume(tmp_path):
    manager = CheckpointManager(str(tmp_path), 3)
    manager.save(fake_state(1), 1, is_best=False)
    with pytest.raises(UserError, match="--resume") as caught:
        manager.resume_path(None, restarted=False)
    assert str(tmp_path / "last.pt") in str(caught.value)
    assert "--checkpoints-path" in str(caught.value)


def test_restarted_round_continues_from_last_whatever_resume_says(tmp_path):
    manager = CheckpointManager(str(tmp_path), 3)
    manager.save(fake_state(1), 1, is_best=False)
    manager.save(fake_state(2), 2, is_best=False)
    last = str(tmp_path / "last.pt")
    assert manager.resume_path(None, restarted=True) == last
    assert manager.resume_path("auto", restarted=True) == last
    assert manager.resume_path(str(tmp_path / "epoch_0001.pt"), restarted=True) == last


def test_restarted_round_without_last_follows_resume(tmp_path):
    manager = CheckpointManager(str(tmp_path), 3)
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


def test_load_of_a_torch_file_without_checkpoint_keys_raises_user_error(tmp_path):
    path = tmp_path / "tensor.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(UserError, match="is not an imagenet_elastic checkpoint") as caught:
        load(str(path))
    assert str(path) in str(caught.value)


# ----------------------------------------------------------------------------- TrainState

def test_the_small_test_model_is_a_timm_model():
    assert timm.is_model("test_resnet")


def make_state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = create_model("test_resnet", num_classes=len(CLASSES))
    optimizer = create_optimizer(model, lr=0.1, momentum=0.9, weight_decay=1e-4, device=torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return TrainState(model=model, optimizer=optimizer, scaler=scaler)


def take_optimizer_steps(state: TrainState, steps: int = 2) -> None:
    """Fill the SGD momentum buffers with made-up gradients (no forward pass: keeps the test fast)."""
    generator = torch.Generator().manual_seed(4)
    for _ in range(steps):
        for param in state.model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        state.optimizer.step()
    with torch.no_grad():  # and move a buffer, so buffers are checked too
        for name, buffer in state.model.named_buffers():
            if name.endswith("running_mean"):
                buffer.add_(0.5)


def round_trip(snapshot: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_train_state_capture_and_apply_restore_everything_through_weights_only_load():
    original = make_state(seed=0)
    take_optimizer_steps(original)
    original.epoch, original.step, original.best_top1 = 3, 42, 61.5
    original.history = [{"epoch": 1, "top1": 50.0}, {"epoch": 2, "top1": 61.5}]
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    snapshot = original.capture({"lr": 0.1}, {"model_name": "test_resnet", "classes": list(CLASSES)})
    expected = (torch.rand(4), random.random(), np.random.rand(3))

    loaded = round_trip(snapshot)
    assert loaded["model_name"] == "test_resnet" and loaded["config"] == {"lr": 0.1}

    restored = make_state(seed=1)
    restored_keys = restored.model.state_dict().keys()
    assert any(not torch.equal(original.model.state_dict()[k], restored.model.state_dict()[k])
               for k in restored_keys)
    random.seed(0)
    np.random.seed(0)
    restored.apply(loaded)

    assert torch.equal(torch.rand(4), expected[0])
    assert random.random() == expected[1]
    np.testing.assert_array_equal(np.random.rand(3), expected[2])
    for key, value in original.model.state_dict().items():
        assert torch.equal(restored.model.state_dict()[key], value), key
    original_opt, restored_opt = original.optimizer.state_dict(), restored.optimizer.state_dict()
    assert original_opt["param_groups"] == restored_opt["param_groups"]
    assert original_opt["state"].keys() == restored_opt["state"].keys() and original_opt["state"]
    for index, buffers in original_opt["state"].items():
        assert torch.equal(restored_opt["state"][index]["momentum_buffer"], buffers["momentum_buffer"])
    assert (restored.epoch, restored.step, restored.best_top1) == (3, 42, 61.5)
    assert restored.history == original.history
    assert restored.history is not loaded["history"]


def test_a_gpu_checkpoints_fused_optimizer_kernel_does_not_follow_it_to_a_cpu_resume():
    gpu_run = make_state(seed=0)
    take_optimizer_steps(gpu_run)
    snapshot = round_trip(gpu_run.capture({}, {}))
    for group in snapshot["optimizer"]["param_groups"]:
        group["fused"] = True  # what create_optimizer sets on CUDA
    cpu_run = make_state(seed=1)
    cpu_run.apply(snapshot)
    assert [g["fused"] for g in cpu_run.optimizer.param_groups] == [None, None]
    assert [g["lr"] for g in cpu_run.optimizer.param_groups] == [g["lr"] for g in gpu_run.optimizer.param_groups]
    take_optimizer_steps(cpu_run, steps=1)  # and the restored momentum buffers still step


def test_train_state_apply_restores_the_random_number_generators():
    state = make_state(seed=0)
    random.seed(21)
    np.random.seed(22)
    torch.manual_seed(23)
    snapshot = round_trip(state.capture({}, {}))
    after_capture = (torch.rand(5), random.random(), np.random.rand(3), np.random.randn())

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    torch.rand(7)
    state.apply(snapshot)
    after_apply = (torch.rand(5), random.random(), np.random.rand(3), np.random.randn())

    assert torch.equal(after_apply[0], after_capture[0])
    assert after_apply[1] == after_capture[1]
    np.testing.assert_array_equal(after_apply[2], after_capture[2])
    assert after_apply[3] == after_capture[3]


def test_train_state_apply_with_a_cached_numpy_gaussian():
    state = make_state(seed=0)
    np.random.seed(5)
    np.random.randn()  # leaves a cached second gaussian in numpy's legacy state
    snapshot = round_trip(state.capture({}, {}))
    expected = np.random.randn(3)
    np.random.seed(6)
    state.apply(snapshot)
    np.testing.assert_array_equal(np.random.randn(3), expected)


# ----------------------------------------------------------------------------- check_compatible

def snapshot_of(model_name: str = "test_resnet", classes=CLASSES) -> dict:
    return {"model_name": model_name, "classes": list(classes)}


def test_check_compatible_accepts_the_same_model_and_classes():
    check_compatible(snapshot_of(), "/ck/last.pt", "test_resnet", CLASSES)


def test_check_compatible_refuses_another_model():
    with pytest.raises(UserError, match="of model 'resnet50', but --model is 'test_resnet'") as caught:
        check_compatible(snapshot_of(model_name="resnet50"), "/ck/last.pt", "test_resnet", CLASSES)
    assert "/ck/last.pt" in str(caught.value)


def test_check_compatible_refuses_another_class_count():
    with pytest.raises(UserError, match="has 2 classes, the data has 3") as caught:
        check_compatible(snapshot_of(classes=("ant", "bee")), "/ck/last.pt", "test_resnet", CLASSES)
    assert "/ck/last.pt" in str(caught.value)


def test_check_compatible_refuses_other_class_names():
    with pytest.raises(UserError, match="other class names") as caught:
        check_compatible(snapshot_of(classes=("ant", "bee", "dog")), "/ck/last.pt", "test_resnet", CLASSES)
    assert "/ck/last.pt" in str(caught.value)


LOCK_HOLDER = r"""
import sys, time
from imagenet_elastic.checkpoint import CheckpointLock
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


def test_lock_of_a_killed_holder_is_free_again(tmp_path):
    holder = hold_lock(tmp_path, 30)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = CheckpointLock(str(tmp_path))
    lock.acquire(5, lambda _: None)
    assert f"pid {os.getpid()}" in (tmp_path / ".lock").read_text()
    lock.release()


def test_waiting_writer_gets_the_lock_when_the_holder_ends(tmp_path):
    holder = hold_lock(tmp_path, 1.0)
    lock = CheckpointLock(str(tmp_path))
    lock.acquire(20, lambda _: None)
    assert holder.wait(timeout=5) == 0
    lock.release()
