"""launch.leave_the_report_to_rank_0: one line for an error every rank meets, whichever rank meets it first."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from imagenet_elastic.errors import UserError
from imagenet_elastic.launch import processes


def test_a_rank_stopped_by_its_launcher_goes_quietly(capsys, monkeypatch, handlers_restored):
    """Rank 0 reported and exited, so the launcher stops the others: they say nothing more."""
    monkeypatch.setattr(processes, "REPORT_GRACE_S", 30.0)
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    processes.leave_the_report_to_rank_0(UserError("global batch 24 does not split evenly over 5 processes"), rank=3)
    assert time.monotonic() - start < 5
    assert capsys.readouterr().err == ""


def test_a_rank_nobody_stops_reports_the_error_as_its_own(capsys, monkeypatch, handlers_restored):
    monkeypatch.setattr(processes, "REPORT_GRACE_S", 0.2)
    processes.leave_the_report_to_rank_0(UserError("cannot read /data/shard3"), rank=3)
    assert capsys.readouterr().err == "imagenet-elastic: error: [rank 3] cannot read /data/shard3\n"


def test_a_stop_that_came_while_the_rank_was_ending_counts_as_the_launchers(capsys, monkeypatch, handlers_restored):
    """The rank's unwinding ends by ignoring the stop signals; a stop that came during it is the error's."""
    monkeypatch.setattr(processes, "REPORT_GRACE_S", 30.0)
    error = UserError("no space left on device writing /ckpt/epoch_0002.pt")
    error.stopped_by = "SIGTERM"
    start = time.monotonic()
    processes.leave_the_report_to_rank_0(error, rank=1)
    assert time.monotonic() - start < 1 and capsys.readouterr().err == ""


def test_a_run_ending_with_an_error_keeps_a_stop_signal_that_came_as_it_unwound(monkeypatch, handlers_restored):
    """What a full disk under torchrun showed: rank 1 raised the storage error, torchrun's SIGTERM came while its
    ExitStack unwound (after rank 0 had reported), and the unwinding ended by ignoring SIGTERM; rank 1 then waited
    out its grace and reported a second line."""
    from imagenet_elastic.config import Config
    from imagenet_elastic.launch.launchers import DistEnv
    from imagenet_elastic.train import trainer as trainer_module

    def build(run, stack):
        stack.callback(os.kill, os.getpid(), signal.SIGTERM)  # the launcher's stop, mid-unwinding
        raise UserError("no space left on device")

    monkeypatch.setattr(trainer_module, "build", build)
    with pytest.raises(UserError) as caught:
        trainer_module.run(Config(data="unused"), DistEnv())
    assert caught.value.stopped_by == "SIGTERM"


def test_a_rank_stopped_at_once_by_ctrl_c_exits_130_not_0(monkeypatch, handlers_restored):
    """torch.multiprocessing takes a spawned rank's KeyboardInterrupt for its parent's stop and exits 0: the rank
    says 130 itself, so no interrupted rank passes for a finished one."""
    from imagenet_elastic.config import Config
    from imagenet_elastic.errors import INTERRUPTED_EXIT
    from imagenet_elastic.launch.launchers import DistEnv

    def interrupted(config, env):
        raise KeyboardInterrupt

    try:
        processes._run_to_exit_code(interrupted, Config(data="unused"), DistEnv())
        ended = "returned"
    except SystemExit as stop:
        ended = stop.code
    except KeyboardInterrupt:  # what torch.multiprocessing would take for exit 0
        ended = "KeyboardInterrupt"
    assert ended == INTERRUPTED_EXIT


class RanksThatStop:
    """torch.multiprocessing's context for spawn_workers: a Ctrl-C comes (to the parent, as to every process of the
    terminal's group) while the parent waits, then the ranks end as `ended` says."""

    def __init__(self, ended: BaseException | None) -> None:
        self.ended = ended
        self.processes: list = []  # none to wait for before the join: it says how they ended

    def pids(self) -> list[int]:
        return []

    def join(self) -> bool:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs
        if self.ended is not None:
            raise self.ended
        return True


@pytest.mark.parametrize("ended", ["finished", "interrupted"])
def test_a_spawn_parent_leaves_ctrl_c_to_its_ranks_and_exits_with_them_without_a_line(capsys, monkeypatch,
                                                                                       handlers_restored, ended):
    import torch.multiprocessing as mp

    from imagenet_elastic.config import Config
    from imagenet_elastic.errors import INTERRUPTED_EXIT
    from imagenet_elastic.launch.launchers import DistEnv

    came: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: came.append(signum))  # the caller's handler
    failure = mp.ProcessExitedException("rank 0 exited", 0, 1, INTERRUPTED_EXIT, None) if ended == "interrupted" \
        else None
    monkeypatch.setattr(processes.mp, "start_processes", lambda *args, **kwargs: RanksThatStop(failure))
    if failure is None:
        processes.spawn_workers(print, Config(data="unused"), DistEnv(), 2)
    else:
        with pytest.raises(SystemExit) as caught:
            processes.spawn_workers(print, Config(data="unused"), DistEnv(), 2)
        assert caught.value.code == INTERRUPTED_EXIT
    assert came == [] and capsys.readouterr().err == ""  # the parent took it, and said nothing
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    assert came == [signal.SIGINT]  # the caller's handler is back
