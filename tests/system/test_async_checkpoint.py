"""Background checkpoint writes keep every guarantee of synchronous ones: real runs, real kills, real files.
Each run is resumed to its end and compared with a run whose saves were all synchronous: the same bits.

resnet18 makes each save ~90 MB, so a write stays in flight long enough to be caught: the test waits
for its temp file and strikes while it exists. --threads 1 everywhere, so a single process and two
torchrun ranks train the same bits (see docs/LAUNCHING.md, Fault tolerance).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fault_injection as fi
import pytest
from conftest import REPO, assert_same_tensors, child_env, finish, load_checkpoint, python_cmd, run, start, torchrun_cmd

from imagenet_elastic.errors import PREEMPTED_EXIT
from imagenet_elastic.report.metrics import read as read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess,
              pytest.mark.usefixtures("warm_ranks")]  # the ranks torchrun starts: forks of the warm python

RUN = ["--model", "resnet18", "--image-size", "32", "--batch-size", "8", "--global-batch-size", "16",
       "--workers", "1", "--threads", "1", "--log-interval", "1", "--warmup-epochs", "1", "--amp", "none",
       "--epochs", "2", "--max-steps-per-epoch", "4", "--checkpoint-interval", "1"]
STEPS = 8


@pytest.fixture(scope="module")
def synchronous_reference(image_folder, tmp_path_factory, warm_python) -> Iterator[Callable[[], Path]]:
    """The same run with every save written before training goes on. It starts at once, beside the first
    test's run (one thread each); calling the fixture's value waits for it and gives its folder."""
    ckpt = tmp_path_factory.mktemp("sync") / "ckpt"
    proc = start(python_cmd(str(image_folder), *RUN, "--no-async-checkpoint", "--checkpoints-path", str(ckpt),
                            python=warm_python))

    @functools.cache
    def finished() -> Path:
        result = finish(proc)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "synchronous writes" in result.stdout
        return ckpt

    yield finished
    if proc.poll() is None:
        proc.kill()


def assert_same_training(ckpt: Path, reference: Path) -> None:
    mine, theirs = load_checkpoint(ckpt / "last.pt"), load_checkpoint(reference / "last.pt")
    assert (mine["epoch"], mine["step"]) == (theirs["epoch"], theirs["step"]) == (2, STEPS)
    assert_same_tensors(mine["model"], theirs["model"])
    assert_same_tensors(mine["optimizer"]["state"], theirs["optimizer"]["state"])
    exact = ("epoch", "val_top1", "val_top5", "val_samples", "lr")
    rows, reference_rows = read_metrics(ckpt / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [[r[k] for k in exact] for r in rows] == [[r[k] for k in exact] for r in reference_rows]
    for key in ("train_loss", "val_loss"):  # a float32 sum of micro-batch losses against a float64 sum of ranks'
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in reference_rows], rel=1e-6)


def temp_files(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(".tmp-")] if folder.is_dir() else []


def wait_for_a_write_in_flight(folder: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Returns once a checkpoint is committed and the next one is being written."""
    deadline = time.monotonic() + timeout
    while not (folder / "last.pt").exists() or not temp_files(folder):
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before a write was caught"
        assert time.monotonic() < deadline, "no checkpoint write in flight was ever seen"
        time.sleep(0.001)


def test_sigkill_during_a_background_write_leaves_the_previous_last_pt_and_resumes_bitwise(
        image_folder, tmp_path, synchronous_reference, warm_python):
    """The run is a new interpreter (SIGSTOP must reach the process that writes); its resume, a warm fork."""
    ckpt = tmp_path / "ckpt"
    args = [str(image_folder), *RUN, "--checkpoints-path", str(ckpt)]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(python_cmd(*args), cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            for _ in range(50):  # freeze the process mid-write; a write that finished first does not count
                wait_for_a_write_in_flight(ckpt, proc)
                fi.stop(proc.pid)
                in_flight = temp_files(ckpt)
                if in_flight:
                    break
                os.kill(proc.pid, signal.SIGCONT)
            assert in_flight, "never stopped the run while a write was in flight"
            before = load_checkpoint(ckpt / "last.pt")  # what the interrupted write was replacing
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert "background writes" in (tmp_path / "log").read_text()
    after = load_checkpoint(ckpt / "last.pt")
    assert after["step"] == before["step"] < STEPS
    assert_same_tensors(after["model"], before["model"])
    assert temp_files(ckpt) == in_flight  # left as it was; the next start removes it
    resumed = run(python_cmd(*args, "--resume", python=warm_python))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"removing {ckpt / in_flight[0]}, left by a write that was interrupted" in resumed.stdout + resumed.stderr
    assert_same_training(ckpt, synchronous_reference())
    assert temp_files(ckpt) == []


def test_preemption_during_a_background_write_waits_for_it_then_checkpoints_and_exits_75(
        image_folder, tmp_path, synchronous_reference):
    ckpt = tmp_path / "ckpt"
    args = [str(image_folder), *RUN, "--checkpoints-path", str(ckpt)]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(torchrun_cmd(2, *args), cwd=REPO, env=child_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_a_write_in_flight(ckpt, proc)
            for pid in fi.workers_by_rank(proc.pid).values():
                os.kill(pid, signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    output = (tmp_path / "log").read_text()
    assert set(re.findall(r"exitcode\s*: (-?\d+)", output)) == {str(PREEMPTED_EXIT)}, output
    stopped = int(re.search(r"stopped after step (\d+) with a checkpoint", output).group(1))
    # exit 75 means the stop's own checkpoint is on disk, written after the one that was in flight
    snapshot = load_checkpoint(ckpt / "last.pt")
    assert snapshot["step"] == stopped < STEPS
    assert temp_files(ckpt) == []
    resumed = run(torchrun_cmd(2, *args, "--resume"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_training(ckpt, synchronous_reference())
