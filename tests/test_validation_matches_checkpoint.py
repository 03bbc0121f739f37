"""In-training validation describes the model that was saved: each epoch's metrics row is what
`--evaluate` of that epoch's checkpoint gives, at any world size, under torchrun and under spawn."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import SMALL_RUN, python_cmd, run, torchrun_cmd

from imagenet_elastic.metrics import read as read_metrics

pytestmark = pytest.mark.slow


def evaluate(image_folder: Path, checkpoint: Path, world_size: int, scratch: Path) -> dict:
    args = [str(image_folder), *SMALL_RUN, "--evaluate", "--resume", str(checkpoint), "--checkpoints-path",
            str(scratch)]
    result = run(python_cmd(*args) if world_size == 1 else torchrun_cmd(world_size, *args))
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_row_describes(row: dict, evaluated: dict) -> None:
    assert (row["val_top1"], row["val_top5"], row["val_samples"]) == (
        evaluated["val_top1"], evaluated["val_top5"], evaluated["val_samples"]), (row, evaluated)
    assert row["val_loss"] == pytest.approx(evaluated["val_loss"], rel=1e-6), (row, evaluated)


def test_each_epochs_metrics_under_torchrun_are_those_of_its_checkpoint(image_folder, torchrun_reference, tmp_path):
    ckpt, _ = torchrun_reference
    rows = read_metrics(ckpt / "metrics.jsonl")
    for epoch, world_size in ((2, 1), (3, 2)):  # the files kept (--keep-checkpoints 2)
        assert_row_describes(rows[epoch - 1], evaluate(image_folder, ckpt / f"epoch_{epoch:04d}.pt", world_size,
                                                       tmp_path / f"eval{epoch}"))


def test_each_epochs_metrics_under_spawn_are_those_of_its_checkpoint(image_folder, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = run(python_cmd(str(image_folder), *SMALL_RUN, "--epochs", "2", "--dist-init-method", "spawn",
                            "--nproc-per-node", "2", "--checkpoints-path", str(ckpt)))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_metrics(ckpt / "metrics.jsonl")
    for epoch in (1, 2):
        assert_row_describes(rows[epoch - 1], evaluate(image_folder, ckpt / f"epoch_{epoch:04d}.pt", 1,
                                                       tmp_path / f"eval{epoch}"))
    # best.pt is the epoch whose recorded top-1 was best (the same file, linked)
    best = max(rows, key=lambda r: r["val_top1"])
    assert os.path.samefile(ckpt / "best.pt", ckpt / f"epoch_{best['epoch']:04d}.pt")
