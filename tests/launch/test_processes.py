"""How a spawn parent waits for its ranks (launch/processes.py wait_for_ranks): a rank that stopped as asked (a
Ctrl-C, a preemption signal) leaves the others time to stop on their own; any other end is torch's join's to act on,
at once. Real processes (forked: each only sleeps, then exits with its code)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from types import SimpleNamespace

import pytest
from conftest import assert_names

from imagenet_elastic.errors import INTERRUPTED_EXIT, PREEMPTED_EXIT, USER_ERROR_EXIT
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.launch.processes import spawn_workers, wait_for_ranks


def _ends(after_s: float, code: int) -> None:
    time.sleep(after_s)
    os._exit(code)


def ranks(*ends: tuple[float, int]) -> list:
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_ends, args=end) for end in ends]
    for process in processes:
        process.start()
    return processes


def waited(processes: list, grace_s: float = 30) -> float:
    began = time.monotonic()
    wait_for_ranks(processes, grace_s)
    return time.monotonic() - began


def test_after_a_rank_stopped_as_asked_the_others_are_waited_for_until_they_end():
    processes = ranks((0.0, INTERRUPTED_EXIT), (1.5, INTERRUPTED_EXIT), (1.0, PREEMPTED_EXIT))
    assert waited(processes) >= 1.4
    assert [p.exitcode for p in processes] == [INTERRUPTED_EXIT, INTERRUPTED_EXIT, PREEMPTED_EXIT]


def test_a_rank_that_failed_ends_the_wait_at_once_and_one_that_outlives_the_grace_is_left_to_torch():
    failed = ranks((0.0, 1), (30.0, 0))
    assert waited(failed) < 10 and failed[1].exitcode is None
    slow = ranks((0.0, PREEMPTED_EXIT), (30.0, PREEMPTED_EXIT))
    assert waited(slow, grace_s=0.5) < 10 and slow[1].exitcode is None
    for process in failed + slow:
        process.kill()
        process.join()


def _never_started(_config: object, _env: DistEnv) -> None:
    raise AssertionError("no rank may start: the store could not listen")


def test_spawn_on_a_master_port_in_use_ends_in_one_line_naming_the_flag_and_port(capsys):
    """It was a DistNetworkError (EADDRINUSE) traceback, exit 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = SimpleNamespace(dist_timeout=5.0, preempt_signals=())
        env = DistEnv(master_port=port, launcher="spawn", store_is_external=True)
        with pytest.raises(SystemExit) as info:
            spawn_workers(_never_started, config, env, 2)
    assert info.value.code == USER_ERROR_EXIT
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert_names(err, "--master-port", port)
