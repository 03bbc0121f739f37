"""Experiment trackers: rank 0 sends Weights & Biases (--wandb PROJECT) and MLflow (--mlflow URI) what steps.jsonl
and metrics.jsonl hold, the resolved settings and the start-up table, as one tracker run per training run.

One interface (`Tracker`), one class per tracker, one registry (`TRACKERS`); `Tracking` drives the chosen ones
beside steps.jsonl and TensorBoard (step_log.StepLog), with three rules:

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
stderr, after which that tracker is left out and training goes on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import re
import secrets
import sys
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Optional

from imagenet_elastic.checkpoint.atomic import atomic_write_bytes
from imagenet_elastic.config import Config
from imagenet_elastic.errors import UserError, one_line
from imagenet_elastic.report.wandb_log import transaction_logs, wandb_history

PENDING = "trackers.json"
TRAIN_KEY = "train/loss"  # in every step row: the step the tracker last holds of steps.jsonl
EPOCH_KEY = "epoch/epoch"  # in every epoch row: ... of metrics.jsonl


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bools too: an epoch row's `resumed` mark becomes 1


def train_values(row: dict[str, Any]) -> dict[str, float]:
    """A steps.jsonl row as the trackers get it: `train/loss`, `train/lr`, ... (its step is the x axis)."""
    return {f"train/{key}": float(value) for key, value in row.items() if key != "step" and is_number(value)}


def epoch_values(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row: `epoch/val_top1`, `epoch/train_loss`, ..., at the step that ended the epoch."""
    return {f"epoch/{key}": float(value) for key, value in row.items() if key != "step" and is_number(value)}


class Tracker(ABC):
    """One tracker, given where its runs go (`where`: the option's value) and the checkpoints folder."""

    option: ClassVar[str]  # the setting's name, and the key of its run id in checkpoints
    package: ClassVar[str]  # the module the extra installs

    def __init__(self, where: str, folder: str) -> None:
        self.where, self.folder = where, folder

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
    def log(self, step: int, values: dict[str, float]) -> None: ...

    @abstractmethod
    def describe(self, facts: dict[str, str]) -> None:
        """The start-up table of this start, which a restart may change (world size, where it resumed from)."""

    @abstractmethod
    def close(self, finished: bool) -> None: ...


class WandbTracker(Tracker):
    """Weights & Biases: PROJECT (WANDB_ENTITY picks the team); WANDB_MODE=offline keeps the runs on disk for
    `wandb sync`. Its files go to WANDB_DIR, else to the checkpoints folder, so that every restart finds the
    transaction logs of the run's earlier starts (`held`)."""

    option, package = "wandb", "wandb"
    NOT_IN_NAME = re.compile(r"[/\\#?%:]")  # W&B refuses these in a project's name

    def __init__(self, where: str, folder: str) -> None:
        super().__init__(where, folder)
        self.dir = os.environ.get("WANDB_DIR") or folder
        self.run: Any = None

    def new_id(self) -> str:
        return secrets.token_hex(4)  # W&B's ids are 8 characters of [a-z0-9]

    def check(self) -> None:
        if not self.where or self.NOT_IN_NAME.search(self.where):
            raise self.refuse("a W&B project name, without / \\ # ? % :")
        try:
            os.makedirs(os.path.join(self.dir, "wandb"), exist_ok=True)
        except OSError as error:
            raise self.refuse(f"cannot make W&B's folder in {self.dir}: {error.strerror or error}") from None
        if not os.access(self.dir, os.W_OK):
            raise self.refuse(f"cannot write W&B's folder {self.dir}")

    def open(self, run_id: Optional[str], name: str, settings: dict[str, Any]) -> str:
        import wandb

        # console="off": the console's lines stay ours (W&B would wrap stdout and stderr).
        self.run = wandb.init(project=self.where, id=run_id or self.new_id(), resume="allow", name=name,
                              dir=self.dir, settings=wandb.Settings(console="off", silent=True))
        self.run.config.update({"settings": settings}, allow_val_change=True)
        return self.run.id

    def logs(self, run_id: str) -> list[str]:
        """This run's transaction logs, one per start, oldest first."""
        return transaction_logs(os.path.join(self.dir, "wandb"), run_id)

    def held(self) -> dict[str, int]:
        last = {TRAIN_KEY: 0, EPOCH_KEY: 0}
        mine = os.path.realpath(os.path.dirname(self.run.dir))  # run.dir is the run folder's files/
        for path in self.logs(self.run.id):
            if os.path.realpath(os.path.dirname(path)) == mine:  # this start's own log: nothing sent yet
                continue
            for step, values in wandb_history(path):
                for key in last:
                    if key in values:
                        last[key] = max(last[key], step)
        return last

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def describe(self, facts: dict[str, str]) -> None:
        self.run.config.update({"startup": facts}, allow_val_change=True)

    def close(self, finished: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if finished else 1)
            self.run = None


class MlflowTracker(Tracker):
    """MLflow: a tracking URI (a server's http(s)://..., sqlite:///PATH, file:PATH); the experiment is
    MLFLOW_EXPERIMENT_NAME, else `imagenet_elastic`.

    MLflow's client waits for its store (a row to sqlite took 70 ms here; a server, a round trip and, when it is
    gone, minutes of retries), so rows go through a queue to a thread of their own, in order: the store holds a
    prefix of what was sent, whatever kills the process, and the next start sends the rest (see `held`). A failure
    in the thread is raised by the next `log` (Tracking then warns once); `close` waits CLOSE_WAIT_S for the queue.
    """

    option, package = "mlflow", "mlflow"
    CLOSE_WAIT_S = 30.0

    def __init__(self, where: str, folder: str) -> None:
        super().__init__(where, folder)
        self.client: Any = None
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self.rows: queue.Queue = queue.Queue()
        self.sender: Optional[threading.Thread] = None
        self.failure: Optional[Exception] = None  # the sender's, raised by the next `log`

    def check(self) -> None:
        import logging

        from mlflow import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # a new sqlite store's "creating tables" lines
        logging.getLogger("alembic").setLevel(logging.WARNING)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "imagenet_elastic"
        try:
            self.client = MlflowClient(tracking_uri=self.where)
            found = self.client.get_experiment_by_name(name)
            self.experiment_id = found.experiment_id if found is not None else self.client.create_experiment(name)
        except Exception as error:  # MLflow's, SQLAlchemy's, the OS's: each says what the store refused
            message = one_line(error)
            if "MLFLOW_ALLOW_FILE_STORE" in message:
                message = ("MLflow keeps its file store for old runs: set MLFLOW_ALLOW_FILE_STORE=true, or use "
                           "sqlite:///PATH")
            raise self.refuse(f"cannot use this MLflow store: {message[:300]}") from None

    def open(self, run_id: Optional[str], name: str, settings: dict[str, Any]) -> str:
        from mlflow.entities import Param

        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return run_id
        run = self.client.create_run(self.experiment_id, run_name=name)
        self.run_id = run.info.run_id
        # Params are written once: MLflow refuses a changed value, and a restart may change a node-local setting.
        self.client.log_batch(self.run_id, params=[Param(key, str(value)[:6000]) for key, value in settings.items()])
        return self.run_id

    def held(self) -> dict[str, int]:
        return {key: max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=0)
                for key in (TRAIN_KEY, EPOCH_KEY)}

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.failure is not None:
            raise self.failure
        if self.sender is None:
            self.sender = threading.Thread(target=self.send_rows, name="mlflow-rows", daemon=True)
            self.sender.start()
        self.rows.put((step, int(time.time() * 1000), values))

    def send_rows(self) -> None:
        from mlflow.entities import Metric

        while (row := self.rows.get()) is not None:
            step, now, values = row
            if self.failure is None:  # after one, the rest is left to the next start
                try:
                    self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step)
                                                                for key, value in values.items()])
                except Exception as error:  # for the training thread to report (see log)
                    self.failure = error

    def describe(self, facts: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(f"startup.{key}", value[:5000])
                                                 for key, value in facts.items()])

    def close(self, finished: bool) -> None:
        if self.sender is not None:
            self.rows.put(None)
            self.sender.join(self.CLOSE_WAIT_S)
            if self.sender.is_alive():
                raise TimeoutError(f"rows still unsent after {self.CLOSE_WAIT_S:g} s; the next start sends those "
                                   "its checkpoint covers")
            self.sender = None
        if self.failure is not None:
            raise self.failure
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")
            self.run_id = None


TRACKERS: dict[str, type[Tracker]] = {cls.option: cls for cls in (WandbTracker, MlflowTracker)}


def installed(package: str) -> bool:
    """Whether `package` can be imported; a None that cli.program left for it in sys.modules (so that timm's
    import of the W&B client fails fast) is taken out first, so that the tracker imports the real one."""
    if package in sys.modules and sys.modules[package] is None:
        del sys.modules[package]
    return importlib.util.find_spec(package) is not None


def chosen(config: Config) -> list[Tracker]:
    """The trackers the settings name (each registered tracker's option), each checked: installed, and its
    destination usable. Rank 0 only."""
    trackers = []
    for option, cls in TRACKERS.items():
        where = getattr(config, option)
        if where is None:
            continue
        tracker = cls(where, config.checkpoints_path)
        if not installed(tracker.package):
            raise UserError(f'{tracker.flag} needs the {tracker.package} package: pip install '
                            f'"imagenet_elastic[{option}]"')
        tracker.check()
        trackers.append(tracker)
    return trackers


class Tracking:
    """Rank 0's trackers for one run (an empty list elsewhere: every call is then nothing)."""

    def __init__(self, trackers: list[Tracker], folder: str, warn: Callable[[str], None]) -> None:
        self.trackers, self.folder, self.warn = list(trackers), folder, warn
        self.runs: dict[str, str] = {}  # option -> run id: what checkpoints save
        self.held: dict[str, dict[str, int]] = {}  # option -> key -> the last step it holds

    @property
    def pending_path(self) -> str:
        return os.path.join(self.folder, PENDING)

    def open(self, saved: dict[str, str], continuing: bool, started_from: Optional[float], name: str,
             settings: dict[str, Any], facts: dict[str, str], rows: list[dict[str, Any]],
             history: list[dict[str, Any]]) -> None:
        """Open each tracker's run: the checkpoint's (`saved`), else the one a start from this same point made
        and recorded in PENDING (when this start continues the folder: --resume, a torchrun restart), else a new
        one. Then what each lacks of `rows` (steps.jsonl up to the checkpoint) and `history` (its epochs) is sent,
        in step order."""
        pending = self.read_pending() if continuing else {}
        for tracker in self.trackers:
            run_id = saved.get(tracker.option)
            earlier = pending.get(tracker.option, {})
            if run_id is None and earlier.get("from") == started_from:
                run_id = earlier.get("id")
            fresh = tracker.option not in saved
            try:
                run_id = run_id or tracker.new_id()
                if fresh and run_id is not None:  # recorded before the run exists, where its id is ours to choose
                    self.record_pending(pending, tracker.option, run_id, started_from)
                self.runs[tracker.option] = tracker.open(run_id, name, settings)
                if fresh:
                    self.record_pending(pending, tracker.option, self.runs[tracker.option], started_from)
                tracker.describe(facts)
                self.held[tracker.option] = tracker.held()
            except UserError:
                raise
            except Exception as error:  # not logged in, server gone, store refused: before training, one line
                raise tracker.refuse(one_line(error)) from None
        backlog = [(row["step"], 0, TRAIN_KEY, train_values(row)) for row in rows]
        backlog += [(row["step"], 1, EPOCH_KEY, epoch_values(row)) for row in history if "step" in row]
        for step, _, key, values in sorted(backlog, key=lambda item: item[:2]):
            self.send(step, key, values)

    def read_pending(self) -> dict[str, Any]:
        try:
            with open(self.pending_path) as f:
                found = json.load(f)
            return found if isinstance(found, dict) else {}
        except (OSError, ValueError):
            return {}

    def record_pending(self, pending: dict[str, Any], option: str, run_id: str, started_from: Optional[float]) -> None:
        if pending.get(option) != {"id": run_id, "from": started_from}:
            pending[option] = {"id": run_id, "from": started_from}
            atomic_write_bytes(json.dumps(pending).encode(), self.pending_path)

    def forget_pending(self) -> None:
        """After a checkpoint that holds the runs' ids (the first of this start)."""
        try:
            os.unlink(self.pending_path)
        except FileNotFoundError:
            pass
        except OSError as error:
            self.warn(f"could not remove {self.pending_path}: {error.strerror or error}")

    def step(self, row: dict[str, Any]) -> None:
        self.send(row["step"], TRAIN_KEY, train_values(row))

    def epoch(self, step: int, row: dict[str, Any]) -> None:
        self.send(step, EPOCH_KEY, epoch_values(row))

    def send(self, step: int, key: str, values: dict[str, float]) -> None:
        """To each tracker that does not hold this step's row of this kind yet."""
        for tracker in list(self.trackers):
            held = self.held.get(tracker.option, {})
            if step <= held.get(key, 0):
                continue
            self.attempt(tracker, lambda tracker=tracker: tracker.log(step, values))
            held[key] = step

    def attempt(self, tracker: Tracker, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as error:  # the server went away, the disk filled: the run goes on without it
            self.trackers.remove(tracker)
            self.warn(f"{tracker.flag} {tracker.where} failed, training goes on without it: {one_line(error)}")
            with contextlib.suppress(Exception):  # it has failed once already, and said so
                tracker.close(finished=False)

    def close(self, finished: bool) -> None:
        for tracker in list(self.trackers):
            self.attempt(tracker, lambda tracker=tracker: tracker.close(finished))
        self.trackers = []
