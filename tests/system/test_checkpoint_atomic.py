"""A SIGKILL in the middle of a checkpoint write never leaves a damaged last.pt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import child_env, load_checkpoint

from imagenet_elastic.checkpoint.store import CheckpointFolder

pytestmark = pytest.mark.slow  # every test here starts processes

WRITER = r"""
import sys, torch
from imagenet_elastic.checkpoint.store import CheckpointFolder
manager = CheckpointFolder(sys.argv[1], keep=1)
version = 0
while True:
    version += 1
    state = {"model": {"w": torch.full((40_000_000,), float(version))}, "epoch": version}
    manager.save(state, epoch=version, is_best=False)
    print(version, flush=True)
"""


def test_sigkill_during_checkpoint_write_leaves_previous_last_pt_loadable(tmp_path):
    for attempt in range(3):
        folder = tmp_path / f"attempt{attempt}"
        folder.mkdir()
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], env=child_env(),
                                stdout=subprocess.PIPE, text=True)
        completed = int(proc.stdout.readline())  # one full save has committed
        deadline = time.monotonic() + 60
        while not any(n.startswith(".tmp-") for n in os.listdir(folder)):  # the next save is mid-write
            assert time.monotonic() < deadline, "no write in progress was ever seen"
            time.sleep(0.001)
        time.sleep(0.01 * attempt)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = load_checkpoint(folder / "last.pt")
        assert state["epoch"] >= completed
        assert bool((state["model"]["w"] == float(state["epoch"])).all()), "last.pt mixes two versions"
        assert any(n.startswith(".tmp-") for n in os.listdir(folder)), "the kill did not land mid-write"
        # and the next start uses it: --resume picks last.pt, the interrupted write is known to be stale
        manager = CheckpointFolder(str(folder), keep=1)
        assert manager.resume_path("auto", restarted=False) == str(folder / "last.pt")
        assert manager.stale_temp_files() and all(".tmp-" in p for p in manager.stale_temp_files())
