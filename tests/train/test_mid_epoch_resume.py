"""A run stopped in the middle of an epoch continues from its checkpoint with the next samples and ends bitwise
where an uninterrupted run ends; mid-epoch checkpoints come every N steps. In this process (tests/inprocess.py),
so the fast tier sees what the slow SIGKILL/SIGTERM runs prove again across real processes."""

from __future__ import annotations

import shutil

import pytest
from conftest import SMALL_RUN, assert_same_tensors, load_checkpoint
from inprocess import train

from imagenet_elastic.report import samplelog

STEPS_PER_EPOCH = 4  # --max-steps-per-epoch: 12 would fit the 96 images at a batch of 8
GLOBAL_BATCH = 8


def args(image_folder, folder, *extra: str) -> list[str]:
    return [str(image_folder), *SMALL_RUN, "--workers", "0", "--threads", "1", "--epochs", "2",
            "--max-steps-per-epoch", str(STEPS_PER_EPOCH), "--checkpoints-path", str(folder), *extra]


def steps_trained(log_dir) -> list[tuple[int, int, list[int]]]:
    """(epoch, step, samples) of every step, in the order trained."""
    return sorted((row["epoch"], row["step"], row["samples"]) for row in samplelog.read(str(log_dir)))


@pytest.fixture(scope="module")
def straight(image_folder, tmp_path_factory):
    """The uninterrupted run: 2 epochs of 4 steps, and which samples each step trained."""
    folder = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(samplelog.ENV_VAR, str(folder / "samples"))
        outcome = train(args(image_folder, folder / "ckpt"))
    assert not outcome.stopped and outcome.final_step == 2 * STEPS_PER_EPOCH
    return folder


@pytest.mark.parametrize("stop_in_step", [2, 6])  # in epoch 1, and in epoch 2 (after epoch 1's checkpoint)
def test_a_run_stopped_mid_epoch_resumes_with_the_next_samples_and_ends_bitwise(
        image_folder, tmp_path, monkeypatch, straight, stop_in_step):
    monkeypatch.setenv(samplelog.ENV_VAR, str(tmp_path / "samples"))
    stopped = train(args(image_folder, tmp_path / "ckpt"), signal_during_step=stop_in_step)
    assert stopped.stopped and stopped.saved_at_steps[-1] == stop_in_step
    snapshot = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    done_in_epoch = stop_in_step - (stop_in_step - 1) // STEPS_PER_EPOCH * STEPS_PER_EPOCH
    assert snapshot["step"] == stop_in_step
    assert snapshot["epoch_progress"]["samples"] == done_in_epoch * GLOBAL_BATCH
    resumed = train(args(image_folder, tmp_path / "ckpt", "--resume"))
    assert not resumed.stopped and resumed.final_step == 2 * STEPS_PER_EPOCH
    assert steps_trained(tmp_path / "samples") == steps_trained(straight / "samples")  # each step's samples once
    final, reference = load_checkpoint(tmp_path / "ckpt" / "last.pt"), load_checkpoint(straight / "ckpt" / "last.pt")
    assert_same_tensors(final["model"], reference["model"])
    assert_same_tensors(final["optimizer"]["state"], reference["optimizer"]["state"])
    assert [r["val_top1"] for r in final["history"]] == [r["val_top1"] for r in reference["history"]]


def test_checkpoints_come_every_n_steps_and_at_each_epochs_end(image_folder, tmp_path):
    """--checkpoint-interval 3 over 2 epochs of 4 steps: steps 3 and 6 mid-epoch, 4 and 8 at the epochs' ends."""
    outcome = train(args(image_folder, tmp_path / "ckpt", "--checkpoint-interval", "3"))
    assert outcome.saved_at_steps == [3, 4, 6, 8]


def test_a_run_stopped_by_a_signal_resumes_from_a_copy_of_its_folder(image_folder, tmp_path, straight):
    """The checkpoint alone carries the run: its folder copied elsewhere (a requeue on another node's scratch)
    resumes there."""
    train(args(image_folder, tmp_path / "first"), signal_during_step=3)
    shutil.copytree(tmp_path / "first", tmp_path / "moved")
    train(args(image_folder, tmp_path / "moved", "--resume"))
    assert_same_tensors(load_checkpoint(tmp_path / "moved" / "last.pt")["model"],
                        load_checkpoint(straight / "ckpt" / "last.pt")["model"])
