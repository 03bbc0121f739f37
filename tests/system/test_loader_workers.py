"""How loader workers start: forked under every launcher, and before the process has other threads."""

from __future__ import annotations

import multiprocessing
import os

from torch.utils.data import Dataset, default_collate

from imagenet_elastic.data import pipeline

SEEN_BY_THIS_PROCESS: list[int] = []


class WhatThisProcessSaw(Dataset):
    """A forked worker holds the parent's memory (and so its file index, shared page by page); a
    spawned one imports this module afresh and sees an empty list."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        return len(SEEN_BY_THIS_PROCESS)


def test_loader_workers_are_forked_even_where_the_default_start_method_is_spawn():
    """Ranks started by `--dist-init-method spawn` inherit the start method "spawn"."""
    previous = multiprocessing.get_start_method()
    SEEN_BY_THIS_PROCESS.append(1)
    multiprocessing.set_start_method("spawn", force=True)
    try:
        loader = pipeline.eval_loader(WhatThisProcessSaw(), 1, rank=0, world_size=1, workers=1, pin_memory=False,
                              collate_fn=default_collate)
        assert [int(batch) for batch in loader] == [1]
    finally:
        multiprocessing.set_start_method(previous, force=True)
        SEEN_BY_THIS_PROCESS.clear()


class IndexAndPid(Dataset):
    """Each read leaves a line in `log`, so the test sees what the workers were asked for."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[int, int]:
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return i, os.getpid()


def test_start_workers_forks_idle_workers_that_the_first_pass_then_uses(tmp_path):
    log = tmp_path / "reads"
    loader = pipeline.eval_loader(IndexAndPid(str(log)), 2, rank=0, world_size=1, workers=1, pin_memory=False,
                              collate_fn=default_collate)
    before = {p.pid for p in multiprocessing.active_children()}
    pipeline.start_workers(loader)
    started = {p.pid for p in multiprocessing.active_children()} - before
    assert len(started) == 1 and not log.exists()  # a worker, and no sample read yet
    for _ in range(2):  # the first pass and a later one: every sample once, in order, from that worker
        batches = list(loader)
        assert [i for indices, _ in batches for i in indices.tolist()] == list(range(6))
        assert {pid for _, pids in batches for pid in pids.tolist()} == started


def test_stopping_the_workers_of_a_live_loader_raises_nothing_when_their_deaths_are_signalled_first(monkeypatch):
    """A rank that ends on an error may still hold its loader's iterator, so torch's SIGCHLD handler is installed
    and watches the workers: the SIGKILL the clean-up sends must not come back as "DataLoader worker is killed"
    (here the signal is made to arrive before the join, where it once did in a refused two-node start)."""
    import signal
    import time
    from multiprocessing.process import BaseProcess

    from torch.utils.data import DataLoader

    kill = BaseProcess.kill

    def kill_then_wait(self) -> None:
        kill(self)
        time.sleep(0.3)

    monkeypatch.setattr(BaseProcess, "kill", kill_then_wait)
    previous = signal.getsignal(signal.SIGCHLD)
    loader = DataLoader(list(range(64)), batch_size=2, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)
    try:
        pipeline.stop_loader_workers()
        assert multiprocessing.active_children() == []
    finally:
        signal.signal(signal.SIGCHLD, previous)
        del batches


def test_a_loader_worker_lives_through_ctrl_c_which_the_training_process_decides(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: a worker that died of it would take the checkpoint the
    first Ctrl-C asks for (launch/preemption.py) down with it."""
    import signal

    from imagenet_elastic.launch.preemption import worker_ignored

    loader = pipeline.eval_loader(IndexAndPid(str(tmp_path / "reads")), 2, rank=0, world_size=1, workers=1,
                                  pin_memory=False, ignored_signals=worker_ignored(("SIGTERM",)),
                                  collate_fn=default_collate)
    [worker] = {int(pid) for _, pids in loader for pid in pids}  # a first pass: the worker has started
    os.kill(worker, signal.SIGINT)
    assert [i for indices, _ in loader for i in indices.tolist()] == list(range(6))
    assert worker in {p.pid for p in multiprocessing.active_children()}
    previous = signal.getsignal(signal.SIGCHLD)
    pipeline.stop_loader_workers()
    signal.signal(signal.SIGCHLD, previous)
