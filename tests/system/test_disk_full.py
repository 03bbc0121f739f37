"""A checkpoint that does not fit: one line naming the file, exit 74, the previous checkpoint intact.

On a real, small tmpfs (mounting one needs root; CI runs as root): the file system itself says
"no space left on device", nothing is faked. Without root these tests skip; as root a failed mount fails them.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import assert_names, load_checkpoint, python_cmd, run, single_line, torchrun_cmd

from imagenet_elastic.checkpoint.store import CheckpointFolder, load
from imagenet_elastic.errors import STORAGE_ERROR_EXIT, StorageError
from imagenet_elastic.report.metrics import read as read_metrics


def written_megabytes(line: str, written: Path, intact: Path | None = None) -> int:
    """The size an out-of-space error line gives for the checkpoint it could not write; it names that file (and,
    where there is one, the previous checkpoint left intact) and says the device was full."""
    assert_names(line, "no space left on device", written, "MB", *([intact] if intact else []))
    return int(re.search(rf"{re.escape(str(written))}\D*(\d+) MB", line).group(1))


@contextlib.contextmanager
def small_tmpfs(path: Path, megabytes: int) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                                 capture_output=True, text=True)
        problem = "" if mounted.returncode == 0 else mounted.stderr.strip() or f"mount exited {mounted.returncode}"
    except OSError as error:
        problem = str(error)
    if problem:  # root, where CI runs: this is the suite's only real ENOSPC, so it never skips quietly
        pytest.fail(f"running as root but could not mount a {megabytes} MB tmpfs at {path}: {problem}", pytrace=False)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def test_a_save_that_does_not_fit_names_the_file_and_leaves_the_previous_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "disk", 12) as disk:
        manager = CheckpointFolder(str(disk), keep=3)
        manager.save({"model": {"w": torch.full((2_000_000,), 1.0)}, "epoch": 1}, 1, is_best=True)  # 8 MB: fits
        with pytest.raises(StorageError) as caught:  # another 8 MB beside the first: does not
            manager.save({"model": {"w": torch.full((2_000_000,), 2.0)}, "epoch": 2}, 2, is_best=True)
        assert written_megabytes(single_line(str(caught.value)), disk / "epoch_0002.pt", disk / "last.pt") == 8
        assert sorted(os.listdir(disk)) == ["best.pt", "epoch_0001.pt", "last.pt"]
        assert load(str(disk / "last.pt"))["epoch"] == 1


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.usefixtures("warm_ranks")  # the ranks torchrun starts: forks of the warm python
def test_a_full_disk_during_training_ends_every_rank_with_one_line_and_exit_74(image_folder, tmp_path):
    """resnet18's state is ~90 MB: epoch 1's checkpoint fits in 130 MB, epoch 2's (written beside it) does not.
    Its background write fails while epoch 3 trains; both ranks stop at the next step boundary."""
    with small_tmpfs(tmp_path / "disk", 130) as disk:
        result = run(torchrun_cmd(2, str(image_folder), "--model", "resnet18", "--image-size", "32",
                                  "--batch-size", "8", "--workers", "1", "--log-interval", "1", "--epochs", "3",
                                  "--checkpoints-path", str(disk)))
        output = result.stdout + result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("imagenet-elastic: error:")]
        assert len(errors) == 1, output
        # epoch 2's checkpoint, as large as epoch 1's, did not fit beside it in 130 MB
        assert 2 * written_megabytes(errors[0], disk / "epoch_0002.pt", disk / "last.pt") > 130, errors
        assert not re.search(r'File ".*imagenet_elastic/', output), output  # torchrun's own summary only
        assert set(re.findall(r"exitcode\s*: (-?\d+)", output)) == {str(STORAGE_ERROR_EXIT)}, output
        assert load_checkpoint(disk / "last.pt")["epoch"] == 1
        assert [row["epoch"] for row in read_metrics(disk / "metrics.jsonl")] == [1]
        assert not [n for n in os.listdir(disk) if n.startswith(".tmp-")]


@pytest.mark.slow
def test_a_single_process_exits_74_when_its_checkpoint_does_not_fit(image_folder, tmp_path):
    with small_tmpfs(tmp_path / "disk", 60) as disk:  # not even the first resnet18 checkpoint fits
        result = run(python_cmd(str(image_folder), "--model", "resnet18", "--image-size", "32", "--batch-size", "16",
                                "--workers", "1", "--epochs", "1", "--max-steps-per-epoch", "1",
                                "--no-async-checkpoint", "--checkpoints-path", str(disk)))
        assert result.returncode == STORAGE_ERROR_EXIT, result.stdout + result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("imagenet-elastic: error:")]
        assert len(errors) == 1, result.stderr
        assert written_megabytes(errors[0], disk / "epoch_0001.pt") > 60, errors  # larger than the disk
        assert "Traceback" not in result.stdout + result.stderr
        assert not [n for n in os.listdir(disk) if n.startswith(".tmp-")]
