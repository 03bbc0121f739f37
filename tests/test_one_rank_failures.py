"""A write that rank 0 alone makes fails after the process group exists: every rank ends within seconds, each with
the same one line naming the real culprit and rank 0's exit code, no traceback, the last checkpoint intact. The
ranks are started by hand, as a scheduler starts tasks, with no launcher that would stop the others: what each rank
says and does on its own is what is seen."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from pathlib import Path

import fault_injection as fi
import inprocess
import pytest
from conftest import REPO, SMALL_RUN, child_env, python_cmd, several_at_once

from imagenet_elastic.errors import STORAGE_ERROR_EXIT

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PREFIX = "imagenet-elastic: error: "


def two_ranks(*args: str) -> list[tuple[subprocess.CompletedProcess, float]]:
    """Ranks 0 and 1 of a job, each started with the variables a launcher sets; (result, seconds it ran)."""
    several_at_once()
    port = str(fi.free_port())
    procs, began = [], time.monotonic()
    for rank in (0, 1):
        env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(python_cmd(*args, "--threads", "1"), cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        results.append((subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - began))
    return results


def assert_every_rank_said(results: list[tuple[subprocess.CompletedProcess, float]], culprit: str) -> None:
    outputs = "\n----\n".join(r.stdout + r.stderr for r, _ in results)
    lines = [[line for line in r.stderr.splitlines() if line.startswith(PREFIX)] for r, _ in results]
    assert [len(found) for found in lines] == [1, 1], outputs
    assert lines[1][0] == lines[0][0].replace(PREFIX, PREFIX + "[rank 1] "), outputs  # the same line on each
    assert culprit in lines[0][0], lines[0][0]
    assert [r.returncode for r, _ in results] == [STORAGE_ERROR_EXIT] * 2, outputs
    assert "Traceback" not in outputs, outputs
    ended = sorted(seconds for _, seconds in results)
    assert ended[1] - ended[0] < 30, ended  # the other rank did not wait for a collective to time out


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def one_epoch(image_folder, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("one_epoch")
    inprocess.train([str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1", "--max-steps-per-epoch", "3",
                     "--checkpoints-path", str(folder)])
    return folder


def test_a_stale_temp_entry_rank_0_cannot_remove_ends_every_rank_with_its_name(image_folder, one_epoch, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(one_epoch, folder)
    (folder / ".tmp-last.pt-abcd").mkdir()  # unlink() refuses a directory
    before = digest(folder / "last.pt")
    results = two_ranks(str(image_folder), *SMALL_RUN, "--epochs", "2", "--max-steps-per-epoch", "3", "--resume",
                        "--checkpoints-path", str(folder))
    assert_every_rank_said(results, f"cannot remove {folder / '.tmp-last.pt-abcd'}, left by an interrupted write")
    assert digest(folder / "last.pt") == before


def test_metrics_jsonl_refused_mid_run_ends_every_rank_with_its_name_not_a_checkpoint(image_folder, tmp_path):
    """Epoch 1's checkpoint is written; the metrics.jsonl write after it is refused: rank 1 used to say 'rank 0
    could not write a checkpoint'."""
    folder = tmp_path / "ckpt"
    (folder / "metrics.jsonl").mkdir(parents=True)  # a rename over it fails
    results = two_ranks(str(image_folder), *SMALL_RUN, "--epochs", "2", "--max-steps-per-epoch", "3",
                        "--checkpoints-path", str(folder))
    assert_every_rank_said(results, f"writing {folder / 'metrics.jsonl'}")
    from conftest import load_checkpoint

    assert load_checkpoint(folder / "last.pt")["epoch"] == 1  # the last committed checkpoint, intact


def test_steps_jsonl_rank_0_cannot_read_at_resume_ends_every_rank_with_its_name(image_folder, one_epoch, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(one_epoch, folder)
    (folder / "steps.jsonl").unlink()
    (folder / "steps.jsonl").mkdir()
    before = digest(folder / "last.pt")
    results = two_ranks(str(image_folder), *SMALL_RUN, "--epochs", "2", "--max-steps-per-epoch", "3", "--resume",
                        "--checkpoints-path", str(folder))
    assert_every_rank_said(results, f"reading {folder / 'steps.jsonl'}")
    assert digest(folder / "last.pt") == before
