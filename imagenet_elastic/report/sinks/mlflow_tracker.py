"""MLflow (--mlflow URI): a tracker (tracker.py's rules) whose rows go to the store from a thread of their own."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Optional

from imagenet_elastic.errors import one_line
from imagenet_elastic.report.sinks.tracker import EPOCH_KEY, TRAIN_KEY, Tracker


class MlflowTracker(Tracker):
    """A tracking URI (a server's http(s)://..., sqlite:///PATH, file:PATH). MLflow's client waits for its store (a
    gone server: minutes of retries), so rows go in order through a queue to a thread of their own: the store holds a
    prefix of what was sent, and the next start sends the rest. A failure in the thread is raised by the next `log`."""

    option, package, metavar = "mlflow", "mlflow", "URI"
    help = ("the same to MLflow at this tracking URI: a server (`http://HOST:5000`) or a local store "
            "(`sqlite:///PATH`); the experiment is `$MLFLOW_EXPERIMENT_NAME`, else imagenet_elastic (`pip install "
            "\"imagenet_elastic[mlflow]\"`)")
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

        if run_id is None:
            self.run_id = self.client.create_run(self.experiment_id, run_name=name).info.run_id
            # params are written once: MLflow refuses a changed value, and a restart may change a node-local setting
            self.client.log_batch(self.run_id, params=[Param(key, str(v)[:6000]) for key, v in settings.items()])
        else:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
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
