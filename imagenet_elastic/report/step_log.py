"""Curves: rank 0's per-step metrics at the log interval, in steps.jsonl, (when installed) TensorBoard and the
experiment trackers (--wandb, --mlflow: see trackers.py, which keeps its own no-repeat rule).

Both continue across kills, restarts and world-size changes without a duplicated or out-of-order
step: at start every row beyond the checkpoint's step is dropped (steps.jsonl is rewritten, and
TensorBoard's `purge_step` hides the events of those steps), and the resumed run logs them again,
with the same values since it trains them again exactly. Each line of steps.jsonl is flushed as it
is written; TensorBoard's events are flushed at every checkpoint, so what a checkpoint covers is on
disk with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from typing import Any, Callable, Optional

from imagenet_elastic.checkpoint.atomic import atomic_write_bytes, storage_error
from imagenet_elastic.errors import UserError
from imagenet_elastic.report.trackers import Tracking

FILENAME = "steps.jsonl"
TENSORBOARD_DIR = "tensorboard"
INSTALL = 'pip install "imagenet_elastic[tensorboard]"'


def tensorboard_wanted(setting: Optional[bool]) -> bool:
    """--tensorboard: always (an error when the package is missing); --no-tensorboard: never; neither:
    when the package is installed."""
    installed = importlib.util.find_spec("tensorboard") is not None
    if setting and not installed:
        raise UserError(f"--tensorboard needs the tensorboard package: {INSTALL}")
    return installed if setting is None else setting


def whole_rows(text: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, row) for each line of a steps.jsonl that is a whole JSON object. Each line is flushed as it is
    written, so the last one of a killed run may be torn: it is left out, as is anything else unreadable."""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            yield line, row


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def kept_rows(text: str, last_step: int) -> list[str]:
    """The lines of a steps.jsonl whose step the checkpoint covers; a torn last line goes too."""
    return [line for line, row in whole_rows(text) if is_number(row.get("step")) and row["step"] <= last_step]


class StepLog:
    """Only rank 0 writes (`enabled`); the other ranks hold an inert one."""

    def __init__(self, folder: str, enabled: bool, tensorboard: bool, start_step: int,
                 warn: Callable[[str], None], tracking: Optional[Tracking] = None) -> None:
        self.path = os.path.join(folder, FILENAME)
        self.warn = warn
        self.tracking = tracking if tracking is not None else Tracking([], folder, warn)
        self.kept: list[dict[str, Any]] = []  # the rows the checkpoint covers, after `trim`
        self.file = None
        self.appending = False
        self.writer: Any = None
        self.tensorboard: Optional[tuple[str, int]] = None  # where and from which step, until the first event
        self.enabled, self.start_step = enabled, start_step
        if enabled and tensorboard:  # its writer makes its event file at once: not before there is something to say
            self.tensorboard = (os.path.join(folder, TENSORBOARD_DIR), start_step + 1)

    def trim(self) -> None:
        """Rank 0, before the first step: the rows beyond the step the run starts from go (a run that died after
        its checkpoint logged them). A file it cannot read or write is a StorageError naming it: call this through
        distributed.rank_0_does, so that every rank says it."""
        if not self.enabled:
            return
        try:
            with open(self.path) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        except OSError as error:
            raise storage_error(error, "reading", self.path) from None
        kept = kept_rows(text, self.start_step)
        self.kept = [json.loads(line) for line in kept]
        if kept != text.splitlines():
            try:
                atomic_write_bytes("".join(line + "\n" for line in kept).encode(), self.path)
            except OSError as error:
                raise storage_error(error, "writing", self.path) from None
        self.appending = True  # the file opens at the first row

    def events(self) -> Any:
        """TensorBoard's writer, made at the first event: a run that fails before it logged anything (a
        corrupt image at the first batch) leaves no event file behind."""
        if self.writer is None and self.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            folder, purge_step = self.tensorboard
            self.writer = SummaryWriter(folder, purge_step=purge_step)
        return self.writer

    def step(self, row: dict[str, Any]) -> None:
        """`row`: step, epoch (fractional), loss, lr, images_per_sec, data_wait."""
        if self.appending:
            try:
                if self.file is None:
                    self.file = open(self.path, "a")  # noqa: SIM115 (open for the whole run; closed in close())
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()
            except OSError as error:  # the checkpoints say what a full disk means; the curves only warn once
                self.warn(f"could not write {self.path}: {error.strerror or error}; per-step metrics stop here")
                self.appending = False
        self.tracking.step(row)
        if self.events() is not None:
            for key in ("loss", "lr", "images_per_sec", "data_wait"):
                self.writer.add_scalar(f"train/{key}", row[key], row["step"])

    def epoch(self, step: int, row: dict[str, Any]) -> None:
        """An epoch's metrics row (see trainer.run_epoch) at the step that ended the epoch."""
        self.tracking.epoch(step, row)
        if self.events() is None:
            return
        for key, value in row.items():
            if key.startswith("val_") and key != "val_samples":
                self.writer.add_scalar(f"val/{key[4:]}", value, step)
        self.writer.add_scalar("train/epoch_loss", row["train_loss"], step)
        self.writer.add_scalar("train/epoch_images_per_sec", row["images_per_sec"], step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self, finished: bool = False) -> None:
        """`finished`: the run trained its last epoch (the trackers mark their runs so)."""
        self.tracking.close(finished)
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
