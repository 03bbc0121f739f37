"""A preemption signal during start-up (launch/preemption.py), in real processes: every rank stops at once with
exit 75 rather than wait for a first step that could come after the scheduler's SIGKILL; rank 0 says so in one line
and nothing is written. Start-up is held open by a checkpoints folder another run holds: rank 0 waits for its lock,
rank 1 for rank 0 in the rendezvous."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from conftest import SMALL_RUN, python_cmd, run_and_kill, torchrun_cmd, torchrun_workers

from imagenet_elastic.checkpoint.store import CheckpointLock
from imagenet_elastic.errors import PREEMPTED_EXIT

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.usefixtures("warm_ranks")]

LOCK_WAIT = "is locked by"  # rank 0's warning while it waits for the checkpoints folder


def held_folder(tmp_path: Path) -> CheckpointLock:
    """A checkpoints folder another run holds: rank 0 waits for it (up to a minute) before it can start."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    lock = CheckpointLock(str(folder))
    lock.acquire(0, lambda _holder: None)
    return lock


def after_a_while(victim, seconds: float = 4.0):
    """`victim`, picked `seconds` after the trigger: the other rank is past its imports too, in its start-up."""
    def pick(proc):
        time.sleep(seconds)
        return victim(proc)
    return pick


def assert_stopped_at_once(output: str, folder: Path, signal_name: str) -> None:
    said = [line for line in output.splitlines() if "before training began" in line]
    assert len(said) == 1 and said[0].startswith(signal_name) and str(PREEMPTED_EXIT) in said[0], output
    assert not re.search(r'File ".*imagenet_elastic/', output), output  # no traceback of ours
    assert "epoch 1/" not in output, output  # not a step trained
    assert not [p.name for p in folder.iterdir() if p.suffix == ".pt" or p.name.startswith(".tmp-")]


def test_sigterm_to_every_torchrun_worker_during_start_up_stops_both_at_once_with_exit_75(image_folder, tmp_path):
    """torchrun's summary holds the workers' exit codes (torchrun itself exits 1 and prints its own
    ChildFailedError traceback for any worker that exited non-zero: not ours to change)."""
    lock = held_folder(tmp_path)
    args = [str(image_folder), *SMALL_RUN, "--epochs", "1", "--checkpoints-path", str(tmp_path / "ckpt")]
    try:
        started = time.monotonic()
        code, output = run_and_kill(torchrun_cmd(2, *args), when=LOCK_WAIT, victim=after_a_while(torchrun_workers),
                                    sig=signal.SIGTERM, timeout=120)
        took = time.monotonic() - started
    finally:
        lock.release()
    assert code != 0, output
    codes = re.findall(r"exitcode\s*: (-?\d+)", output)
    assert codes and set(codes) == {str(PREEMPTED_EXIT)}, output
    assert_stopped_at_once(output, tmp_path / "ckpt", "SIGTERM")
    assert took < 50, f"{took:.0f} s: the stop waited for the lock's minute, not at once\n{output}"


def test_sigusr1_to_a_spawned_job_during_start_up_exits_75_without_a_traceback(image_folder, tmp_path,
                                                                               warm_python):
    """Slurm's one task per node: the signal reaches the task (the spawning parent), which passes it on."""
    lock = held_folder(tmp_path)
    args = [str(image_folder), *SMALL_RUN, "--epochs", "1", "--checkpoints-path", str(tmp_path / "ckpt"),
            "--dist-init-method", "spawn", "--nproc-per-node", "2"]
    try:
        code, output = run_and_kill(python_cmd(*args, python=warm_python), when=LOCK_WAIT,
                                    victim=after_a_while(lambda proc: proc.pid), sig=signal.SIGUSR1, timeout=120)
    finally:
        lock.release()
    assert code == PREEMPTED_EXIT, output
    assert "Traceback" not in output, output
    assert_stopped_at_once(output, tmp_path / "ckpt", "SIGUSR1")
