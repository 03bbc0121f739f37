"""Weights & Biases (--wandb PROJECT): a tracker (tracker.py's rules), through W&B's own service process, so a row
never holds the training loop up."""

from __future__ import annotations

import os
import re
import secrets
from typing import Any, Optional

from imagenet_elastic.report.sinks.tracker import EPOCH_KEY, TRAIN_KEY, Tracker
from imagenet_elastic.report.sinks.wandb_log import transaction_logs, wandb_history


class WandbTracker(Tracker):
    """PROJECT (WANDB_ENTITY picks the team). Its files go to WANDB_DIR, else to the checkpoints folder, so that every
    restart finds the transaction logs of the run's earlier starts (`held`)."""

    option, package, metavar = "wandb", "wandb", "PROJECT"
    help = ("rank 0 also logs steps.jsonl's and metrics.jsonl's rows, the settings and the start-up table to this "
            "Weights & Biases project (`pip install \"imagenet_elastic[wandb]\"`; `WANDB_MODE=offline` keeps the run "
            "on disk for `wandb sync`); a restart, requeue or --resume continues the same run, without a step twice")
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

        # console="off": W&B would wrap stdout and stderr
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

    def finish(self, finished: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if finished else 1)
            self.run = None
