"""Preemption pieces that need no cluster: signal names, the flag a handler raises, the Slurm job to requeue."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import assert_names

from imagenet_elastic.errors import UserError
from imagenet_elastic.launch.preemption import PreemptionFlag, StoppedAtOnce, parse_signals, slurm_job_to_requeue


@pytest.mark.parametrize("text,expected", [
    ("SIGTERM,SIGUSR1", ("SIGTERM", "SIGUSR1")),
    ("term, usr1", ("SIGTERM", "SIGUSR1")),
    ("USR2", ("SIGUSR2",)),
    ("SIGTERM,TERM", ("SIGTERM",)),
    ("none", ()),
])
def test_signal_names_are_normalised(text, expected):
    assert parse_signals(text) == expected


@pytest.mark.parametrize("text", ["SIGKILL", "STOP", "SIGFOO", ""])
def test_signals_that_cannot_be_caught_are_refused(text):
    with pytest.raises(UserError, match="--preempt-signals"):
        parse_signals(text)


@pytest.mark.parametrize("text", ["SIGCHLD", "CLD", "winch", "SIGPIPE", "SIGCONT", "SIGSEGV", "SIGTERM,SIGTSTP"])
def test_signals_that_cannot_mean_a_preemption_are_refused_naming_the_flag(text):
    """SIGCHLD was accepted, then the run stopped at start-up when a child process ended."""
    with pytest.raises(UserError) as info:
        parse_signals(text)
    assert_names(str(info.value), "--preempt-signals", repr(text.split(",")[-1]))


def test_flag_records_the_first_signal_and_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGUSR2)
    flag = PreemptionFlag(("SIGUSR2", "SIGUSR1"))
    try:
        assert flag.received is None
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received == "SIGUSR2"  # the process is still alive: the handler only set the flag
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGUSR2) == before


def signal_self(signum: int, seconds: float = 2) -> None:
    """`signum` to this process, and time for its handler to run (a handler that raises ends the wait)."""
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_signal_during_start_up_stops_at_once_past_except_exception_and_only_the_first():
    flag = PreemptionFlag(("SIGUSR2",))
    try:
        with flag.starting():
            with pytest.raises(StoppedAtOnce) as stop:
                try:
                    signal_self(signal.SIGUSR2)
                except Exception:  # start-up code's own handling must not take the stop for its failure
                    pytest.fail("StoppedAtOnce was caught by `except Exception`")
            signal_self(signal.SIGUSR2, 0.2)  # a second one (a launcher's, while the rank unwinds): no raise
        assert (stop.value.signal_name, flag.received, flag.stops_at_once) == ("SIGUSR2", "SIGUSR2", False)
    finally:
        flag.restore()


def test_a_signal_before_start_up_began_stops_it_as_it_begins():
    flag = PreemptionFlag(("SIGUSR2",))
    try:
        signal_self(signal.SIGUSR2, 0.2)  # between the handler's install and the start-up
        with pytest.raises(StoppedAtOnce), flag.starting():
            pass
    finally:
        flag.restore()


def test_a_signal_once_start_up_ended_only_sets_the_flag():
    flag = PreemptionFlag(("SIGUSR2",))
    try:
        with flag.starting():
            pass
        signal_self(signal.SIGUSR2, 0.2)  # the process is still alive: the agreed stop at the step boundary
        assert flag.received == "SIGUSR2"
    finally:
        flag.restore()


def interrupt_self(flag: PreemptionFlag) -> None:
    """Ctrl-C to this process, and time for its handler to run: until the flag is raised (or a KeyboardInterrupt)."""
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 2
    while flag.received is None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_ctrl_c_while_training_is_a_checkpointed_stop_said_at_once_and_a_second_stops_at_once(capfd):
    before = signal.getsignal(signal.SIGINT)
    flag = PreemptionFlag(("SIGTERM",), interrupts=True, speaks=True)
    try:
        with pytest.raises(KeyboardInterrupt):  # before training: at once, nothing to lose
            interrupt_self(flag)
        assert flag.received is None
        flag.checkpoint_on_interrupt, flag.steps_done = True, 7
        interrupt_self(flag)  # the process is still alive: a stop at the step, like a preemption signal's
        assert (flag.received, flag.received_after, flag.interrupted) == ("SIGINT", 7, True)
        assert "Ctrl-C again stops at once" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            interrupt_self(flag)
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) == before


def test_ctrl_c_in_the_first_step_stays_the_checkpointed_stop_where_a_preemption_signal_stops_at_once():
    """The first step runs in `starting` too (trainer.until_first_step): a Ctrl-C there, or one before it, still asks
    for the checkpoint at the step's end (exit 130), as it does in any step; StoppedAtOnce is preemption's (exit 75)."""
    flag = PreemptionFlag(("SIGTERM",), interrupts=True, speaks=False)
    try:
        flag.checkpoint_on_interrupt = True
        with flag.starting():
            interrupt_self(flag)
        assert (flag.received, flag.interrupted) == ("SIGINT", True)
        with flag.starting():  # a Ctrl-C came before the step began
            pass
    finally:
        flag.restore()


def test_ctrl_c_named_in_the_preemption_signals_stays_one_and_a_test_flag_leaves_it_alone():
    before = signal.getsignal(signal.SIGINT)
    plain = PreemptionFlag(("SIGTERM",))  # interrupts=False
    plain.restore()
    assert plain._previous.keys() == {signal.SIGTERM}
    flag = PreemptionFlag(("SIGINT",), interrupts=True)
    try:
        interrupt_self(flag)
        assert (flag.received, flag.interrupted) == ("SIGINT", False)  # exit 75 as asked, not 130
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) == before


@pytest.mark.parametrize("environ,job", [
    ({"SLURM_JOB_ID": "123"}, "123"),
    ({"SLURM_JOB_ID": "130", "SLURM_ARRAY_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "7"}, "123_7"),
    ({}, None),
    ({"SLURM_JOB_ID": ""}, None),
])
def test_requeue_names_the_array_task_not_the_internal_job_id(environ, job):
    assert slurm_job_to_requeue(environ) == job
