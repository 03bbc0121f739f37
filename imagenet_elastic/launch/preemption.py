"""Preemption: signals only raise a flag, which `Trainer` turns into an agreed checkpoint and stop at a step boundary
(a handler that wrote the checkpoint itself could run in the middle of an optimizer step or a collective).

During start-up (`starting`), and again in the rank's first step (its compile can take minutes), there is nothing
trained to checkpoint, and waiting for a step to end could outlast the scheduler's grace period, whose SIGKILL would
skip the requeue: the first signal stops the rank at once (StoppedAtOnce, exit 75). A handler runs only once a wait
in C++ returns: the rendezvous waits in Python's sleeps (distributed.join_round).

Ctrl-C asks for the same stop while the run trains (exit 130): whoever stops a run at a terminal means to continue or
change it, which wants the checkpoint. A second Ctrl-C stops at once, as does one before training begins or after."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Optional

from imagenet_elastic.errors import UserError, first_line
from imagenet_elastic.options import option

# Signals that cannot mean "preempted": uncaught (KILL, STOP), sent by the system for other reasons (a child's end,
# a terminal's resize or job control, a closed pipe, a profiler's timer) or for the process's own faults
NOT_PREEMPTION = {getattr(signal, name) for name in (
    "SIGKILL", "SIGSTOP", "SIGCHLD", "SIGCONT", "SIGWINCH", "SIGURG", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGPIPE",
    "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS", "SIGPROF", "SIGVTALRM", "SIGIO")
    if hasattr(signal, name)}


def parse_signals(text: str) -> tuple[str, ...]:
    """`SIGTERM,USR1` -> ("SIGTERM", "SIGUSR1"); `none` -> (). Unknown names, and NOT_PREEMPTION's, are a user
    error."""
    if text.strip().lower() == "none":
        return ()
    names = []
    for item in text.split(","):
        name = item.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in signal.Signals.__members__ or signal.Signals[name] in NOT_PREEMPTION:
            raise UserError(f"--preempt-signals: {item.strip()!r} is not a signal that can be caught and mean a "
                            "preemption")
        names.append(name)
    return tuple(dict.fromkeys(names))


def signals_option(text: str) -> tuple[str, ...]:
    """--preempt-signals' type: parse_signals, its error as argparse reports a bad value."""
    try:
        return parse_signals(text)
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error).split(": ", 1)[-1]) from None


@dataclass(frozen=True)
class PreemptionSettings:
    """Which signals mean "checkpoint at the next step and stop", and what follows the stop."""

    preempt_signals: tuple[str, ...] = option(
        ("SIGTERM", "SIGUSR1"), "signals that mean \"checkpoint at the next step and exit 75\"; `none` turns this off",
        "checkpoints", "SIGNALS", type=signals_option)
    requeue_on_preempt: bool = option(
        False, "after that checkpoint, rank 0 runs `scontrol requeue` for this Slurm job (array tasks too)",
        "checkpoints", action=argparse.BooleanOptionalAction)


def signal_numbers(names: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(int(signal.Signals[name]) for name in names)


def worker_ignored(names: tuple[str, ...]) -> tuple[int, ...]:
    """The signals loader workers ignore (preemption's and Ctrl-C, which reaches the whole process group): the
    training process decides what each means; a worker that died of one would end the run."""
    return tuple(dict.fromkeys((*signal_numbers(names), int(signal.SIGINT))))


INTERRUPT_NOTE = (b"Ctrl-C: stopping after the step in flight (after validation, if it runs), with a checkpoint; "
                  b"Ctrl-C again stops at once, keeping only the last checkpoint\n")


class StoppedAtOnce(BaseException):
    """A preemption signal during start-up. A BaseException, as KeyboardInterrupt is: raised wherever start-up code
    happens to be, it must not be taken by an `except Exception` there for that code's own failure."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class PreemptionFlag:
    """Installs the handlers; `received` names the first signal that came, None until then. `interrupts`: Ctrl-C too;
    while `checkpoint_on_interrupt`, the first Ctrl-C is a stop like the others, else a KeyboardInterrupt."""

    def __init__(self, names: tuple[str, ...], interrupts: bool = False, speaks: bool = True) -> None:
        self.received: Optional[str] = None
        self.steps_done = 0
        self.received_after: Optional[int] = None  # steps_done when the signal came
        self.interrupted = False  # the stop is a Ctrl-C's
        self.checkpoint_on_interrupt = False
        self.training_began = False  # from then on the trainer says what a Ctrl-C kept (before, trainer.run does)
        self.stepped = False  # every rank is past its first step: a stop from then on is the agreed one
        self.stops_at_once = False  # while `starting`
        self.speaks = speaks
        self._previous = {signum: signal.signal(signum, self._handle) for signum in signal_numbers(names)}
        if interrupts and signal.SIGINT not in self._previous:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)

    def _handle(self, signum: int, _frame: Optional[FrameType]) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            self.received_after = self.steps_done
            if self.stops_at_once and not self.interrupted:
                raise StoppedAtOnce(self.received)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Start-up: the first preemption signal raises StoppedAtOnce (see above), also one that came since the handlers
        were installed (not a Ctrl-C); no longer once start-up ended or failed, before the caller's cleanups run."""
        self.stops_at_once = True
        try:
            if self.received is not None and not self.interrupted:
                raise StoppedAtOnce(self.received)
            yield
        finally:
            self.stops_at_once = False

    def _interrupt(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is not None or not self.checkpoint_on_interrupt:
            raise KeyboardInterrupt
        self.interrupted = True  # first: a Ctrl-C is the checkpointed stop, also in the first step
        self._handle(signum, frame)
        if self.speaks:  # os.write: a handler's print could re-enter a write the signal interrupted
            os.write(2, INTERRUPT_NOTE)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def ignore_from_now(self) -> None:
        """SIG_IGN, unlike a Python handler, stays in force while the interpreter shuts down."""
        for signum in self._previous:
            signal.signal(signum, signal.SIG_IGN)


def slurm_job_to_requeue(environ: Mapping[str, str]) -> Optional[str]:
    """The job id `scontrol requeue` needs: `ARRAYJOB_TASK` for an array task, else SLURM_JOB_ID."""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else environ.get("SLURM_JOB_ID") or None


def requeue_slurm_job(job: str) -> str:
    """Ask Slurm to put the job back in the queue; returns what went wrong (scontrol's first line), or "" on
    success."""
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return first_line(error)
    said = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    return "" if done.returncode == 0 else (said or [f"scontrol exited with {done.returncode}"])[0]
