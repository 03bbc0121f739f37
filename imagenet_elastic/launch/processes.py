"""Start the worker: in this process, or as N local processes (spawn, or a Slurm task per node). A child that stopped
as asked (Ctrl-C, a preemption signal, which every rank takes) is not a failure: the others stop on their own."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.connection
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from imagenet_elastic.errors import (
    INTERRUPTED_EXIT,
    PREEMPTED_EXIT,
    PROG,
    STORAGE_ERROR_EXIT,
    USER_ERROR_EXIT,
    Preempted,
    UserError,
    report,
)
from imagenet_elastic.launch.distributed import port_in_use
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.launch.preemption import signal_numbers

# a module-level function (spawn pickles it by name), given the caller's config as it came (spawn_workers reads its
# dist_timeout and preempt_signals) and this rank's DistEnv
Entry = Callable[[Any, DistEnv], None]


def run_worker(entry: Entry, config: Any, env: DistEnv) -> None:
    """One rank, wrapped with torch's elastic `record` so a crash reaches torchrun's error summary; user errors and
    preemption end inside it as plain exit codes (SystemExit), so the summary holds no traceback for them."""
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_run_to_exit_code)(entry, config, env)


def _run_to_exit_code(entry: Entry, config: Any, env: DistEnv) -> None:
    try:
        entry(config, env)
    except UserError as error:
        if env.rank == 0 or error.every_rank or (error.every_node and env.local_rank == 0):
            report(error, env.rank, own=True)
        else:
            leave_the_report_to_rank_0(error, env.rank)
        sys.exit(error.exit_code)
    except Preempted as stop:
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # a spawned rank would exit 0 (torch.multiprocessing takes it for its parent's stop)
        sys.exit(INTERRUPTED_EXIT)


REPORT_GRACE_S = 10.0


def leave_the_report_to_rank_0(error: UserError, rank: int) -> None:
    """An error every rank meets is said once, by rank 0. A rank that gets there first must not exit first (its
    launcher would stop rank 0 before it said anything): it waits for the launcher's stop (or `error.stopped_by`),
    then goes quietly; with no stop within REPORT_GRACE_S the error was its own, and it says so."""
    if error.stopped_by is not None:
        return
    stops: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda received, _frame: stops.append(received))
    deadline = time.monotonic() + REPORT_GRACE_S
    while not stops and time.monotonic() < deadline:
        time.sleep(0.05)  # a signal ends the sleep at once
    if not stops:
        report(error, rank, own=True)


def _child(index: int, entry: Entry, config: Any, task_env: DistEnv, procs: int) -> None:
    run_worker(entry, config, task_env.child(index, procs))


def spawn_workers(entry: Entry, config: Any, task_env: DistEnv, procs: int) -> None:
    if task_env.store_is_external:
        # single-node spawn: this parent hosts the store until its children end, on a free port it holds before they
        # start, so no port is guessed and none can be taken in between
        try:
            store = dist.TCPStore(task_env.master_addr, task_env.master_port, is_master=True,
                                  timeout=timedelta(seconds=config.dist_timeout), wait_for_workers=False)
        except RuntimeError as error:
            if not port_in_use(error):
                raise
            report(UserError(f"--master-port {task_env.master_port} is already in use on this host: pass another, "
                             "or none for a free one"), 0)
            sys.exit(USER_ERROR_EXIT)
        task_env = dataclasses.replace(task_env, master_port=store.port)
    logging.getLogger("torch.multiprocessing.spawn").addFilter(not_terminating)
    context = mp.start_processes(_child, args=(entry, config, task_env, procs), nprocs=procs, join=False,
                                 start_method="spawn")

    def forward(signum: int, _frame: object) -> None:  # to the ranks, rather than die (SIGUSR1) and orphan them
        for pid in context.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    forwarded: dict[int, object] = {signum: signal.signal(signum, forward)
                                    for signum in signal_numbers(config.preempt_signals)}
    # a terminal's Ctrl-C reaches the ranks themselves (one process group): the parent forwards none (a second each)
    forwarded[signal.SIGINT] = signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    try:
        wait_for_ranks(context.processes)
        while not context.join():
            pass
    except mp.ProcessExitedException as failed:
        if failed.exit_code not in (USER_ERROR_EXIT, STORAGE_ERROR_EXIT, PREEMPTED_EXIT, INTERRUPTED_EXIT):  # said
            print(f"{PROG}: error: local process {failed.error_index} (rank "
                  f"{task_env.rank * procs + failed.error_index}) exited with code {failed.exit_code}; "
                  "the others were stopped", file=sys.stderr)
        sys.exit(failed.exit_code if failed.exit_code and failed.exit_code > 0 else 1)
    except mp.ProcessRaisedException as failed:
        reported = [p.exitcode for p in context.processes if p.exitcode in (USER_ERROR_EXIT, STORAGE_ERROR_EXIT)]
        if reported:
            # a rank stopped on a user or storage error; this rank's (a closed connection) followed and only hides it
            sys.exit(reported[0])
        rank = task_env.rank * procs + failed.error_index
        print(f"{PROG}: error: rank {rank} failed, the others were stopped:\n{failed}", file=sys.stderr)
        sys.exit(1)
    finally:
        for signum, handler in forwarded.items():
            signal.signal(signum, handler)


def not_terminating(record: logging.LogRecord) -> bool:
    """Leaves out torch's "Terminating process N via signal SIGTERM" (one a rank, after one failed): below, the
    failure is said in one line. Its other warnings (a rank killed after it ignored the SIGTERM) stay."""
    return not record.getMessage().startswith("Terminating process")


ASKED_STOPS = (INTERRUPTED_EXIT, PREEMPTED_EXIT)  # the exits of a stop every rank is asked for
STOP_GRACE_S = 60.0


def wait_for_ranks(processes: list, grace_s: float = STOP_GRACE_S) -> None:
    """Until every rank has ended, or one ended otherwise than with 0 or an asked-for stop (then torch's join stops
    the rest). After an asked-for stop the others are stopping too, so they get `grace_s` rather than be cut short."""
    deadline = None
    pending = list(processes)
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([p.sentinel for p in pending], timeout)
        if not ready:
            return  # the grace is over: torch's join stops what is left
        for process in [p for p in pending if p.sentinel in ready]:
            process.join()
            if process.exitcode not in (0, *ASKED_STOPS):
                return
            if process.exitcode in ASKED_STOPS and deadline is None:
                deadline = time.monotonic() + grace_s
        pending = [p for p in pending if p.exitcode is None]
