"""Experiment trackers (--wandb PROJECT, --mlflow URI): what every tracker shares, as one `Tracker` sink that each
tracker's module fills in. One tracker run per training run, whatever restarts it: its id is saved in every checkpoint
and, until one holds it, in CHECKPOINTS/trackers.json (PENDING). (MLflow chooses its own id: a death between making a
run and recording it leaves that run empty.)

No step twice, none backward: trackers cannot delete rows, so at start each says the last step it holds of each kind of
row (`held`: a run killed while validating has sent its epoch's last step, not the epoch's row), and rows up to it are
not sent again. (W&B's server refuses a step not past a resumed run's last one, so online that one epoch row may be
lost; untested without a W&B server.)"""

from __future__ import annotations

import contextlib
import json
import os
from abc import abstractmethod
from typing import Any, Callable, ClassVar, Optional

from imagenet_elastic.atomic_files import atomic_write_bytes
from imagenet_elastic.errors import UserError, one_line
from imagenet_elastic.report import metrics
from imagenet_elastic.report.sinks.base import Beginning, Sink

TRAIN_KEY = f"{metrics.TRAIN}/loss"  # in every step row: the step the tracker last holds of steps.jsonl
EPOCH_KEY = f"{metrics.EPOCH}/epoch"  # in every epoch row: ... of metrics.jsonl
PENDING = "trackers.json"  # keeps a new run's id until a checkpoint does (the first rule)


class TrackerRuns:
    """Which tracker run each tracker continues, and what checkpoints save of them (`ids`: option -> run id)."""

    def __init__(self, folder: str, warn: Callable[[str], None]) -> None:
        self.path = os.path.join(folder, PENDING)
        self.warn = warn
        self.ids: dict[str, str] = {}
        self.saved: dict[str, str] = {}  # the checkpoint's
        self.pending: dict[str, Any] = {}  # PENDING's: option -> {"id", "from": the checkpoint's time stamp}
        self.started_from: Optional[float] = None

    def begin(self, saved: dict[str, str], continuing: bool, started_from: Optional[float]) -> None:
        """`saved`: the checkpoint's runs; `continuing`: this start continues the folder, so that a run PENDING holds
        from the same checkpoint (`started_from`) is continued."""
        self.saved, self.started_from = dict(saved), started_from
        self.pending = {}
        if continuing:
            with contextlib.suppress(OSError, ValueError), open(self.path) as f:
                found = json.load(f)
                self.pending = found if isinstance(found, dict) else {}

    def earlier(self, option: str) -> Optional[str]:
        """The run to continue: the checkpoint's, else the one a start from this same point made and recorded."""
        if option in self.saved:
            return self.saved[option]
        earlier = self.pending.get(option)
        return earlier.get("id") if isinstance(earlier, dict) and earlier.get("from") == self.started_from else None

    def made(self, option: str, run_id: str) -> None:
        """A run is made or continued: checkpoints save it from now on, PENDING until one does."""
        recorded = {"id": run_id, "from": self.started_from}
        if option not in self.saved and self.pending.get(option) != recorded:
            self.pending[option] = recorded
            atomic_write_bytes(json.dumps(self.pending).encode(), self.path)
        self.ids[option] = run_id

    def forget_pending(self) -> None:
        """After a checkpoint that holds the runs' ids (the first of this start)."""
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        except OSError as error:
            self.warn(f"could not remove {self.path}: {error.strerror or error}")


class Tracker(Sink):
    """One tracker, given where its runs go (`where`: the option's value) and the checkpoints folder. A tracker's
    module fills in the methods below `refuse`; a new tracker is that module and a line in TRACKERS."""

    option: ClassVar[str]  # the setting's name, and the key of its run id in checkpoints
    package: ClassVar[str]  # the module the extra installs
    metavar: ClassVar[str]  # for --help and docs/OPTIONS.md's option table
    help: ClassVar[str]

    def __init__(self, where: str, folder: str) -> None:
        self.where, self.folder = where, folder
        self.flag = f"--{self.option}"
        self.name = f"{self.flag} {where}"
        self.last = {TRAIN_KEY: 0, EPOCH_KEY: 0}  # the last step the run holds of each kind of row

    def refuse(self, problem: str) -> UserError:
        return UserError(f"{self.flag} {self.where}: {problem}")

    @abstractmethod
    def check(self) -> None:
        """Before anything else starts (no thread, no worker): that runs can be made there, else a UserError."""

    def new_id(self) -> Optional[str]:
        """The id of a new run, where the tracker lets its caller choose it (None: the store chooses)."""

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
    def close(self, finished: bool) -> None:
        """Mark the run finished (`finished`) or killed, after the rows still in flight."""

    def start(self, beginning: Beginning) -> None:
        """Open the run (see TrackerRuns.earlier), then send the rows it lacks, in step order."""
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
