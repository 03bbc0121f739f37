"""A preemption signal during start-up (launch/preemption.py), in real processes: every rank stops at once with
exit 75 rather than wait for a first step that could come after the scheduler's SIGKILL; rank 0 says so in one line
and nothing is written. Start-up is held open by a checkpoints folder another run holds: rank 0 waits for its lock,
rank 1 for rank 0 in the rendezvous."""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import fault_injection as fi
import pytest
from conftest import (
    SMALL_RUN,
    assert_names,
    child_env,
    python_cmd,
    run,
    run_and_kill,
    several_at_once,
    torchrun_cmd,
    torchrun_workers,
)

from imagenet_elastic.checkpoint.store import CheckpointLock
from imagenet_elastic.errors import PREEMPTED_EXIT, USER_ERROR_EXIT

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


def test_sigterm_while_the_first_step_compiles_stops_at_once_without_a_checkpoint(image_folder, tmp_path):
    """A compile (inductor, for real, on tests/compiled_small.py's model; minutes on a GPU) is the first step's: the
    signal stops the run at once, rather than after the compile, the step and a save."""
    folder = tmp_path / "ckpt"
    cmd = [sys.executable, "tests/compiled_small.py", str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1",
           "--compile", "--checkpoints-path", str(folder)]
    env = child_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # empty: the compile takes its time
    code, output = run_and_kill(cmd, when="checkpoint and exit 75", victim=after_a_while(lambda proc: proc.pid, 1.0),
                                sig=signal.SIGTERM, timeout=120, env=env)  # the start-up table's last row
    assert code == PREEMPTED_EXIT, output
    assert_stopped_at_once(output, folder, "SIGTERM")  # no step trained, no checkpoint


RANK_1_LACKS_DATA = '#!/bin/sh\n[ "$RANK" = 1 ] && DATA="$DATA.missing"\nexec "$PY" -m imagenet_elastic "$DATA" "$@"\n'


@pytest.mark.mostly_waiting  # rank 1 waits for a launcher's stop before it says its error (REPORT_GRACE_S)
def test_torchrun_stopping_rank_0_after_rank_1_failed_at_start_up_is_no_preemption(image_folder, tmp_path,
                                                                                   warm_python):
    """Rank 1 alone meets a bad input (its node lacks the data) and exits 2; torchrun then SIGTERMs rank 0, which
    hosts the rendezvous store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as in scripts/torchrun_elastic.sh) and waits
    there for rank 1: it stops at once (not SIGKILLed 30 s later), and its line claims no preemption."""
    several_at_once()
    script = tmp_path / "rank.sh"
    script.write_text(RANK_1_LACKS_DATA)
    script.chmod(0o755)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           f"--rdzv-conf={fi.FAST_RDZV_CONF}", "--no-python", str(script), *SMALL_RUN, "--epochs", "1",
           "--checkpoints-path", str(tmp_path / "ckpt")]
    done = run(cmd, timeout=120, env=child_env(**{fi.SHARED_STORE_OFF: "1"}, PY=warm_python, DATA=str(image_folder)))
    output = done.stdout + done.stderr
    codes = dict(re.findall(r"rank\s*: (\d) \(local_rank.*\n\s*exitcode\s*: (-?\d+)", output))
    assert codes == {"0": str(PREEMPTED_EXIT), "1": str(USER_ERROR_EXIT)}, output
    errors = [line for line in output.splitlines() if line.startswith("imagenet-elastic: error:")]
    assert len(errors) == 1 and f"{image_folder}.missing" in errors[0], output
    said = [line for line in output.splitlines() if "before training began" in line]
    assert len(said) == 1, output
    assert_names(said[0], "SIGTERM", "launcher", PREEMPTED_EXIT)
