"""The build takes its data as two Source objects (train, val) from its caller: a run on images held in memory,
with no data folder, trains, checkpoints, stops at a preemption signal and resumes bitwise. What any new source
gets by implementing the interface (data/sources/base.py), shown with the smallest one."""

from __future__ import annotations

import pytest
from conftest import SMALL_RUN, assert_same_tensors, load_checkpoint
from inprocess import evaluate, in_memory, train

NOWHERE = "/nonexistent-data"  # DATA is not read when the splits are given


def args(folder, *extra: str) -> list[str]:
    return [NOWHERE, *SMALL_RUN, "--workers", "0", "--threads", "1", "--epochs", "3", "--max-steps-per-epoch", "4",
            "--checkpoints-path", str(folder), *extra]


@pytest.fixture(scope="module")
def splits():
    return in_memory(classes=4, train_per_class=16, val_per_class=5)


@pytest.fixture(scope="module")
def straight(splits, tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    outcome = train(args(folder), splits=splits)
    assert not outcome.stopped and outcome.final_step == 12
    return folder


def test_a_run_on_images_in_memory_learns_and_its_rows_describe_its_checkpoints(splits, straight, tmp_path):
    history = load_checkpoint(straight / "last.pt")["history"]
    assert [row["epoch"] for row in history] == [1, 2, 3]
    assert all(row["val_samples"] == len(splits[1]) for row in history)
    assert max(row["val_top1"] for row in history) > 50.0  # 4 classes: chance is 25%
    scores = evaluate([*args(tmp_path), "--evaluate", "--resume", str(straight / "last.pt")], splits=splits)
    assert (scores["val_top1"], scores["val_samples"]) == (history[-1]["val_top1"], len(splits[1]))


def test_a_run_on_images_in_memory_stopped_mid_epoch_resumes_bitwise(splits, straight, tmp_path):
    stopped = train(args(tmp_path), signal_during_step=6, splits=splits)
    assert stopped.stopped and stopped.saved_at_steps[-1] == 6
    resumed = train(args(tmp_path, "--resume"), splits=splits)
    assert not resumed.stopped and resumed.final_step == 12
    final, reference = load_checkpoint(tmp_path / "last.pt"), load_checkpoint(straight / "last.pt")
    assert_same_tensors(final["model"], reference["model"])
    assert_same_tensors(final["optimizer"]["state"], reference["optimizer"]["state"])


def test_train_and_val_splits_with_other_classes_are_refused(splits, tmp_path):
    from imagenet_elastic.errors import UserError

    other_val = in_memory(classes=3, train_per_class=1, val_per_class=2)[1]
    with pytest.raises(UserError, match="classes differ"):
        train(args(tmp_path), splits=(splits[0], other_val))
    assert not (tmp_path / "last.pt").exists()
