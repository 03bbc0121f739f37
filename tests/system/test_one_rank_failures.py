"""A write that rank 0 alone makes fails after the process group exists: every rank ends within seconds, each with
the same one line naming the real culprit and rank 0's exit code, no traceback, the last checkpoint intact. The
ranks are started by hand, as a scheduler starts tasks, with no launcher that would stop the others: what each rank
says and does on its own is what is seen."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fault_injection as fi
import pytest
from conftest import REPO, SMALL_RUN, child_env, load_checkpoint, python_cmd, several_at_once

from imagenet_elastic.errors import STORAGE_ERROR_EXIT

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.mostly_waiting]  # rank 1: REPORT_GRACE_S

PREFIX = "imagenet-elastic: error: "


def two_ranks(python: str, *args: str,
              **extra_env: str) -> Callable[[], list[tuple[subprocess.CompletedProcess, float]]]:
    """Starts ranks 0 and 1 of a job, each with the variables a launcher sets, and returns the function that waits
    for them: (result, seconds each ran, timed by a thread of its own, so that jobs can run side by side). `python`:
    the interpreter (the test run's warm one: a fork that has imported torch); `extra_env`: variables for both."""
    several_at_once()
    port = str(fi.free_port())
    began = time.monotonic()
    results: dict[int, tuple[subprocess.CompletedProcess, float]] = {}

    def rank_runs(rank: int) -> None:
        env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra_env)
        program = [str(REPO / "tests" / "save_held.py")] if extra_env else python_cmd()[1:]
        done = subprocess.run([python, *program, *args, "--threads", "1"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        results[rank] = (done, time.monotonic() - began)

    threads = [threading.Thread(target=rank_runs, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()

    def ended() -> list[tuple[subprocess.CompletedProcess, float]]:
        for thread in threads:
            thread.join()
        assert sorted(results) == [0, 1], "a rank ran past its 120 s"  # the thread's TimeoutExpired
        return [results[0], results[1]]

    return ended


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
def jobs(image_folder, one_epoch_run, warm_python, tmp_path_factory) -> dict[str, tuple[Path, str, list]]:
    """The three failures' jobs, started side by side (rank 1 of each spends most of its time waiting for a
    launcher's stop that never comes, launch.processes.REPORT_GRACE_S): for each, its checkpoints folder, the
    digest of its last.pt before (or "") and the ranks' results."""
    base = tmp_path_factory.mktemp("one_rank")
    run = [str(image_folder), *SMALL_RUN, "--epochs", "2", "--max-steps-per-epoch", "3"]
    folders = {name: base / name / "ckpt" for name in ("stale temp", "metrics.jsonl", "steps.jsonl")}
    for name in ("stale temp", "steps.jsonl"):
        shutil.copytree(one_epoch_run, folders[name])
    (folders["stale temp"] / ".tmp-last.pt-abcd").mkdir()  # unlink() refuses a directory
    folders["metrics.jsonl"].mkdir(parents=True)
    (folders["steps.jsonl"] / "steps.jsonl").unlink()
    (folders["steps.jsonl"] / "steps.jsonl").mkdir()
    before = {name: digest(folder / "last.pt") if (folder / "last.pt").exists() else ""
              for name, folder in folders.items()}
    blocked = {"SAVE_HOLD_S": "0", "SAVE_HELD_THEN_FOLDER": str(folders["metrics.jsonl"] / "metrics.jsonl")}
    waits = {name: two_ranks(warm_python, *run, *([] if name == "metrics.jsonl" else ["--resume"]),
                             "--checkpoints-path", str(folder), **(blocked if name == "metrics.jsonl" else {}))
             for name, folder in folders.items()}  # metrics.jsonl: a folder made there once epoch 1's checkpoint is
    # written (tests/save_held.py; one there at the start is refused then): a rename over it fails
    return {name: (folders[name], before[name], ended()) for name, ended in waits.items()}


def test_a_stale_temp_entry_rank_0_cannot_remove_ends_every_rank_with_its_name(jobs):
    folder, before, results = jobs["stale temp"]
    assert_every_rank_said(results, f"cannot remove {folder / '.tmp-last.pt-abcd'}, left by an interrupted write")
    assert digest(folder / "last.pt") == before


def test_metrics_jsonl_refused_mid_run_ends_every_rank_with_its_name_not_a_checkpoint(jobs):
    """Epoch 1's checkpoint is written; the metrics.jsonl write after it is refused: rank 1 used to say 'rank 0
    could not write a checkpoint'."""
    folder, _, results = jobs["metrics.jsonl"]
    assert_every_rank_said(results, f"writing {folder / 'metrics.jsonl'}")
    assert load_checkpoint(folder / "last.pt")["epoch"] == 1  # the last committed checkpoint, intact


def test_steps_jsonl_rank_0_cannot_read_at_resume_ends_every_rank_with_its_name(jobs):
    folder, before, results = jobs["steps.jsonl"]
    assert_every_rank_said(results, f"reading {folder / 'steps.jsonl'}")
    assert digest(folder / "last.pt") == before
