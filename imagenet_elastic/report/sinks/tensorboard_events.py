"""TensorBoard (--tensorboard): every number of every row, as the trackers name them (`train/loss`, `epoch/val_top1`),
in CHECKPOINTS/tensorboard. A resumed run continues the same curves: the writer's `purge_step` hides the events beyond
the checkpoint's step, which the resumed run logs again."""

from __future__ import annotations

import os
import threading
from typing import Any

from imagenet_elastic.report import metrics
from imagenet_elastic.report.sinks.base import Beginning, Sink

FOLDER = "tensorboard"
WRITER_THREAD_MODULE = "tensorboard.summary.writer.event_file_writer"  # where the writer's thread class is defined


def quiet_writer_threads() -> None:
    """The writer's thread keeps the error it meets (a folder it may not write, a full disk), which the writer's next
    add, flush or close raises in the training thread, for Sinks' one warning: the thread's own traceback (through
    threading.excepthook) would say it again. Other threads' errors still reach the hook that was there."""
    previous = threading.excepthook
    if getattr(previous, "quiets_writer_threads", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__module__ != WRITER_THREAD_MODULE:
            previous(args)

    hook.quiets_writer_threads = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TensorBoard(Sink):
    def __init__(self, folder: str) -> None:
        self.folder = os.path.join(folder, FOLDER)
        self.name = f"TensorBoard {self.folder}"
        self.purge_step = 1  # the first step this start logs: the checkpoint's next
        self.writer: Any = None

    def start(self, beginning: Beginning) -> None:
        self.purge_step = beginning.step + 1

    def add(self, kind: str, row: dict[str, Any]) -> None:
        if self.writer is None:  # made at the first event: a run that fails before logging leaves no event file
            from torch.utils.tensorboard import SummaryWriter

            quiet_writer_threads()
            self.writer = SummaryWriter(self.folder, purge_step=self.purge_step)
        for tag, value in metrics.scalars(kind, row).items():
            self.writer.add_scalar(tag, value, row["step"])

    def step(self, row: dict[str, Any]) -> None:
        self.add(metrics.TRAIN, row)

    def epoch(self, row: dict[str, Any]) -> None:
        self.add(metrics.EPOCH, row)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self, finished: bool) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
