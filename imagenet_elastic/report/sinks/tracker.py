"""Experiment trackers (--wandb PROJECT, --mlflow URI): what every tracker shares, as one `Tracker` sink that each
tracker's module fills in (wandb_tracker.py, mlflow_tracker.py; the list is sinks/__init__.py's TRACKERS). Rank 0
sends each the numbers of steps.jsonl's and metrics.jsonl's rows, the resolved settings and the start-up table, as
one tracker run per training run, with three rules:

One run, whatever restarts it. A tracker run's id is made once, at the first start, and saved in every checkpoint
(`trackers`), so a torchrun restart, a Slurm requeue or --resume continues it. Until the first checkpoint holds it,
it is kept in CHECKPOINTS/trackers.json (PENDING), written as soon as the run is made and removed once a
checkpoint holds it: a run killed before its first checkpoint restarts into the same tracker run, and a folder
whose checkpoints are later deleted does not lend its old run to a new one. A start that would not continue the
folder (no --resume, no torchrun restart) makes a new run. (A W&B id is chosen here and recorded before the run is
made; MLflow's store chooses its own, so a death in the milliseconds between making an MLflow run and recording it
leaves that run empty and the restart makes another.)

No step twice, none backward. A run killed after its last checkpoint has sent steps beyond it, and the resumed run
trains those steps again (resume is step-exact, so with the same values; bitwise on CPU). The trackers cannot
delete rows (MLflow has no API for it, W&B's rewind needs its server), so at start each tracker says which step it
last holds of each kind of row (`held`: MLflow's metric history; W&B's own transaction logs in its folder, the
records `wandb sync` uploads), and rows up to it are not sent again. Rows it lacks that steps.jsonl and the
checkpoint's history hold (lost in flight at a kill, or a tracker first named at a resume) are sent first, in step
order. The two kinds are counted apart: a run killed while validating has sent its epoch's last step, not the
epoch's row. (W&B keeps one row per step: the offline logs hold that epoch row at the step's row, but W&B's server
refuses a step that is not past a resumed run's last one, so online, or synced, that one epoch row may be lost; not
seen here, where there is no W&B server.)

A tracker never stops training. A setting it cannot use at start (package missing, a store that cannot be
created) is one line and exit 2, before training; a failure later (server gone, disk full) is one warning on
stderr, after which that tracker is left out and training goes on (the container's rule: sinks/__init__.py).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, Optional

from imagenet_elastic.errors import UserError, one_line
from imagenet_elastic.report import metrics
from imagenet_elastic.report.sinks.base import Beginning, Sink
from imagenet_elastic.report.sinks.runs import PENDING, TrackerRuns  # noqa: F401  (the trackers' state, re-exported)

TRAIN_KEY = f"{metrics.TRAIN}/loss"  # in every step row: the step the tracker last holds of steps.jsonl
EPOCH_KEY = f"{metrics.EPOCH}/epoch"  # in every epoch row: ... of metrics.jsonl


class Tracker(Sink):
    """One tracker, given where its runs go (`where`: the option's value) and the checkpoints folder. A tracker's
    module fills in the methods below `refuse`, and its class names its setting: a new tracker is that module and a
    line in TRACKERS (plus Config's one-line field, whose help and metavar come from here)."""

    option: ClassVar[str]  # the setting's name, and the key of its run id in checkpoints
    package: ClassVar[str]  # the module the extra installs
    metavar: ClassVar[str]  # for --help and docs/OPTIONS.md's option table
    help: ClassVar[str]  # ditto

    def __init__(self, where: str, folder: str) -> None:
        self.where, self.folder = where, folder
        self.name = f"{self.flag} {where}"
        self.last = {TRAIN_KEY: 0, EPOCH_KEY: 0}  # the last step the run holds of each kind of row

    @property
    def flag(self) -> str:
        return f"--{self.option}"

    def refuse(self, problem: str) -> UserError:
        return UserError(f"{self.flag} {self.where}: {problem}")

    @abstractmethod
    def check(self) -> None:
        """Before anything else starts (no thread, no worker): that runs can be made there, else a UserError."""

    def new_id(self) -> Optional[str]:
        """The id of a new run, where the tracker lets its caller choose it (None: the store chooses)."""
        return None

    @abstractmethod
    def open(self, run_id: Optional[str], name: str, settings: dict[str, Any]) -> str:
        """Continue run `run_id` (a new run where no run has it yet), or make a new one (None); returns its id."""

    @abstractmethod
    def held(self) -> dict[str, int]:
        """The last step the run holds of each of TRAIN_KEY and EPOCH_KEY (0: none)."""

    @abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None:
        """One row's numbers at `step`; it must not wait for a server (a queue, a service process)."""

    @abstractmethod
    def describe(self, facts: dict[str, str]) -> None:
        """The start-up table of this start, which a restart may change (world size, where it resumed from)."""

    @abstractmethod
    def finish(self, finished: bool) -> None:
        """Mark the run finished (`finished`) or killed, after the rows still in flight."""

    # ------------------------------------------------------------------ the rules every tracker shares

    def start(self, beginning: Beginning) -> None:
        """Open the run (see TrackerRuns.earlier), then send what it lacks of steps.jsonl's rows up to the
        checkpoint and of the checkpoint's epochs, in step order. Anything the tracker raises while opening (not
        logged in, server gone, store refused) is one line, before training."""
        runs = beginning.runs
        try:
            run_id = runs.earlier(self.option) or self.new_id()
            if run_id is not None:  # recorded before the run exists, where its id is ours to choose
                runs.made(self.option, run_id)
            runs.made(self.option, self.open(run_id, beginning.name, beginning.settings))
            self.describe(beginning.facts)
            self.last = self.held()
        except UserError:
            raise
        except Exception as error:
            raise self.refuse(one_line(error)) from None
        backlog = [(row["step"], 0, TRAIN_KEY, metrics.scalars(metrics.TRAIN, row)) for row in beginning.rows]
        backlog += [(row["step"], 1, EPOCH_KEY, metrics.scalars(metrics.EPOCH, row))
                    for row in beginning.history if "step" in row]
        for step, _, key, values in sorted(backlog, key=lambda item: item[:2]):
            self.send(step, key, values)

    def step(self, row: dict[str, Any]) -> None:
        self.send(row["step"], TRAIN_KEY, metrics.scalars(metrics.TRAIN, row))

    def epoch(self, row: dict[str, Any]) -> None:
        self.send(row["step"], EPOCH_KEY, metrics.scalars(metrics.EPOCH, row))

    def send(self, step: int, key: str, values: dict[str, float]) -> None:
        """Unless the run holds this step's row of this kind already."""
        if step > self.last[key]:
            self.log(step, values)
            self.last[key] = step

    def close(self, finished: bool) -> None:
        self.finish(finished)
