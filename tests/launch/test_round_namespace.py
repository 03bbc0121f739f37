"""Every round of a job agrees on a store namespace no earlier round used, on one long-lived store."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from imagenet_elastic.launch.distributed import join_round


@pytest.fixture
def store_port():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    yield server.port
    del server


def run_round(port: int, world_size: int, delays: dict[int, float], timeout_s: float = 10) -> list[str]:
    """Each rank in its own thread with its own store client, starting after delays[rank] seconds."""
    names: list[str] = [""] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            threading.Event().wait(delays.get(rank, 0.0))
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
            names[rank] = join_round(client, rank, world_size, timeout_s)
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 10)
    assert not errors, errors
    return names


def test_rounds_of_changing_size_each_get_one_fresh_namespace(store_port):
    """2 ranks, then 1 (an agent died), then 3 (agents joined), then 2: as torchrun elastic would."""
    seen = []
    for world_size, delays in [(2, {}), (1, {}), (3, {0: 0.3}), (2, {1: 0.3})]:
        names = run_round(store_port, world_size, delays)
        assert len(set(names)) == 1, f"ranks of one round disagree: {names}"
        seen.append(names[0])
    assert len(set(seen)) == len(seen), f"a namespace was reused: {seen}"


def test_followers_that_start_before_rank_0_do_not_take_the_previous_round(store_port):
    """The stale announcement of the previous round is visible first; followers must wait it out."""
    first = run_round(store_port, 3, {})[0]
    second = run_round(store_port, 3, {0: 0.5})  # ranks 1 and 2 read the old leader key first
    assert set(second) == {second[0]} and second[0] != first


def test_previous_round_that_died_mid_handshake_does_not_block_the_next(store_port):
    """A round whose rank 1 never arrived leaves an announcement without a member list behind."""
    client = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=20))
    with pytest.raises(TimeoutError, match="timeout"):
        join_round(client, 0, 2, timeout_s=0.5)
    names = run_round(store_port, 2, {0: 0.3})
    assert names[0] == names[1]


def test_rank_0_alone_times_out_with_an_error():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with pytest.raises(TimeoutError, match="timeout"):
        join_round(server, 0, 2, timeout_s=0.5)


def test_rank_0_s_timeout_names_the_first_members_missing_and_counts_the_rest():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with pytest.raises(TimeoutError) as raised:
        join_round(server, 0, 6, timeout_s=0.5)
    missing = str(raised.value).split("keys missing: ")[1]
    assert [key.rsplit("/", 1)[1] for key in missing.split(" and ")[0].split(", ")] == ["member1", "member2", "member3"]
    assert missing.endswith(" and 2 more")


def test_follower_without_rank_0_times_out_with_an_error():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with pytest.raises(TimeoutError, match="timeout"):
        join_round(server, 1, 2, timeout_s=0.5)


class Stop(BaseException):
    pass


@pytest.mark.parametrize("rank", [0, 1])
def test_a_signal_to_a_rank_waiting_for_its_peers_is_taken_at_once_not_after_the_timeout(rank):
    """A preemption signal's handler runs only between Python's steps: a rank waiting for a late peer must not sit in
    one C++ wait of --dist-timeout (launch/preemption.py stops start-up at once)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))

    def stop(_signum, _frame):
        raise Stop

    previous = signal.signal(signal.SIGUSR2, stop)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR2))
    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(Stop):
            join_round(server, rank, 2, timeout_s=20)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR2, previous)
    assert time.monotonic() - started < 5
