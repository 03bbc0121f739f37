"""The program's build steps and training loop run in the test's own process: one rank, no process group,
loader workers as asked (`--workers 0` keeps them in this process). What the `imagenet-elastic` command does
with the same arguments, without the ~3.5 s a new process costs; the tests that need a process boundary
(ranks, launchers, kills) start real ones instead.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from imagenet_elastic import cli
from imagenet_elastic.errors import Preempted
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.launch.preemption import PreemptionFlag
from imagenet_elastic.report.console import Console
from imagenet_elastic.train import startup
from imagenet_elastic.train.trainer import Trainer


@dataclass
class Outcome:
    stopped: bool  # a preemption stop (exit 75 for the command)
    saved_at_steps: list[int] = field(default_factory=list)  # the optimizer step of every checkpoint, in order
    final_step: int = 0


def train(argv: Sequence[str], signal_during_step: Optional[int] = None,
          before_fit: Optional[Callable[[Trainer], None]] = None) -> Outcome:
    """`imagenet-elastic ARGV` in this process. `signal_during_step`: a preemption signal (SIGTERM) arrives
    while that optimizer step trains (counted from 1 over the run), as from a cluster's scheduler."""
    config, _ = cli.parse(list(argv))
    threads = torch.get_num_threads()  # the build sets the run's own (--threads)
    preempt = PreemptionFlag(())  # no handlers in the test process: the signal is delivered by hand
    outcome = Outcome(stopped=False)
    try:
        with contextlib.ExitStack() as stack:
            trainer = startup.build(config, DistEnv(), Console(True, config.log_interval), preempt, stack)
            watch(trainer, preempt, signal_during_step, outcome)
            if before_fit is not None:
                before_fit(trainer)
            try:
                trainer.fit()
            except Preempted:
                outcome.stopped = True
            outcome.final_step = trainer.state.step
    finally:
        torch.set_num_threads(threads)
    return outcome


def evaluate(argv: Sequence[str]) -> dict:
    """`imagenet-elastic ARGV --evaluate --resume CHECKPOINT` in this process: the JSON line's values."""
    config, _ = cli.parse(list(argv))
    assert config.evaluate, "pass --evaluate"
    threads = torch.get_num_threads()
    try:
        with contextlib.ExitStack() as stack:
            trainer = startup.build(config, DistEnv(), Console(True, config.log_interval), PreemptionFlag(()), stack)
            return trainer.validate()
    finally:
        torch.set_num_threads(threads)


def watch(trainer: Trainer, preempt: PreemptionFlag, signal_during_step: Optional[int], outcome: Outcome) -> None:
    """Record each save's step; deliver the signal at the end of the step it is due in, where the loop asks."""
    checkpointer, state = trainer.checkpointer, trainer.state
    at_step_end, save = checkpointer.at_step_end, checkpointer.save

    def at_step_end_with_signal(step: int, stop_requested: bool) -> tuple[bool, bool]:
        if step == signal_during_step and preempt.received is None:
            preempt.steps_done = step - 1  # the handler ran while this step trained
            preempt._handle(signal.SIGTERM, None)
            stop_requested = True
        return at_step_end(step, stop_requested)

    def recorded_save(*args, **kwargs) -> None:
        outcome.saved_at_steps.append(state.step)
        save(*args, **kwargs)

    checkpointer.at_step_end = at_step_end_with_signal  # type: ignore[method-assign]
    checkpointer.save = recorded_save  # type: ignore[method-assign]
