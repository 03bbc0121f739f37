"""The program run in the test's own process: one rank, no process group, loader workers as asked (`--workers 0`
keeps them in this process), on the data its arguments name or on splits held in memory (`InMemory`). What the
`imagenet-elastic` command does with the same arguments, without the ~3.5 s a new process costs; the tests that
need a process boundary (ranks, launchers, kills) start real ones instead.

    train(argv)       the build steps and fit(), a preemption signal delivered by hand at a chosen step
    evaluate(argv)    --evaluate's scores
    command(argv)     the whole command line (cli.main): its exit code, stdout and stderr, as a process has them
"""

from __future__ import annotations

import contextlib
import io
import random
import signal
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from PIL import Image

from imagenet_elastic import cli
from imagenet_elastic.data.sources import Source
from imagenet_elastic.errors import Preempted
from imagenet_elastic.launch.launchers import DistEnv
from imagenet_elastic.launch.preemption import PreemptionFlag
from imagenet_elastic.report.console import Console
from imagenet_elastic.train import trainer as trainer_module
from imagenet_elastic.train.build import Run
from imagenet_elastic.train.trainer import Trainer


@dataclass
class Outcome:
    stopped: bool  # a preemption stop (exit 75 for the command)
    saved_at_steps: list[int] = field(default_factory=list)  # the optimizer step of every checkpoint, in order
    final_step: int = 0


@dataclass(frozen=True)
class InMemory(Source):
    """A split held in this process: encoded images and their labels, no file behind them."""

    role: str
    classes: tuple[str, ...]
    images: tuple[bytes, ...]
    labels: np.ndarray

    def read(self, i: int) -> bytes:
        return self.images[i]

    def name(self, i: int) -> str:
        return f"<memory {self.role} #{i}>"

    def where(self) -> str:
        return f"memory ({len(self)} images)"

    def entries(self) -> np.ndarray:
        return np.array([f"{i}".encode() for i in range(len(self))])


def in_memory(classes: int = 4, train_per_class: int = 24, val_per_class: int = 9, size: tuple[int, int] = (48, 40),
              seed: int = 0) -> tuple[InMemory, InMemory]:
    """Learnable train and val splits of JPEGs made here: class k is a disc of its own colour on noise."""
    rng = random.Random(seed)
    noise = np.random.default_rng(seed)

    def image(label: int) -> bytes:
        width, height = size
        pixels = noise.integers(0, 80, (height, width, 3), dtype=np.uint8)
        cy, cx, r = rng.randint(10, height - 10), rng.randint(10, width - 10), rng.randint(6, 12)
        yy, xx = np.ogrid[:height, :width]
        pixels[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = [(60 * label) % 256, 255 - 50 * label, 128]
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=90)
        return out.getvalue()

    names = tuple(f"class_{k:03d}" for k in range(classes))
    splits = []
    for role, per_class in (("train", train_per_class), ("val", val_per_class)):
        labels = [k for k in range(classes) for _ in range(per_class)]
        splits.append(InMemory(role, names, tuple(image(k) for k in labels), np.array(labels, dtype=np.int64)))
    return splits[0], splits[1]


def train(argv: Sequence[str], signal_during_step: Optional[int] = None,
          before_fit: Optional[Callable[[Trainer], None]] = None,
          splits: Optional[tuple[Source, Source]] = None) -> Outcome:
    """`imagenet-elastic ARGV` in this process. `signal_during_step`: a preemption signal (SIGTERM) arrives
    while that optimizer step trains (counted from 1 over the run), as from a cluster's scheduler. `splits`:
    train on these instead of DATA's (pass any DATA: it is not read)."""
    config, _ = cli.parse(list(argv))
    threads = torch.get_num_threads()  # the build sets the run's own (--threads)
    preempt = PreemptionFlag(())  # no handlers in the test process: the signal is delivered by hand
    outcome = Outcome(stopped=False)
    try:
        with contextlib.ExitStack() as stack:
            trainer = trainer_module.build(Run(config, DistEnv(), Console(True), preempt), stack,
                                    splits)
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


def evaluate(argv: Sequence[str], splits: Optional[tuple[Source, Source]] = None) -> dict:
    """`imagenet-elastic ARGV --evaluate --resume CHECKPOINT` in this process (of `splits`' val source, where given):
    the JSON line's values."""
    from imagenet_elastic.tools.evaluate import evaluate_checkpoint

    config, _ = cli.parse(list(argv))
    assert config.evaluate, "pass --evaluate"
    threads = torch.get_num_threads()
    try:
        return evaluate_checkpoint(config, DistEnv(), splits[1] if splits is not None else None)
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Finished:
    """What a command left: as subprocess.CompletedProcess has it."""

    returncode: int
    stdout: str
    stderr: str


SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


def command(argv: Sequence[str], main: Callable[[list[str]], None] = cli.main) -> Finished:
    """`imagenet-elastic ARGV` as a whole (cli.main: parse, launch plan, the run, its exit code) in this process,
    with its output captured; or another command line's `main` (bench/benchmark.py's). The run's signal handlers,
    and the ignoring of signals it sets as it ends, are undone afterwards; so are its thread count."""
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            # torch's @record would point faulthandler at stderr, which has no file descriptor here
            warnings.filterwarnings("ignore", message="Unable to enable fault handler")
            main(list(argv))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        torch.set_num_threads(threads)
    return Finished(code, out.getvalue(), err.getvalue())


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
