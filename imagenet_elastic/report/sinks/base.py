"""The interface every sink implements, and what a start tells them (`Beginning`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Beginning:
    """Where this start continues the run from, for the sinks to catch up (rank 0, before the first step)."""

    step: int  # the checkpoint's optimizer step; 0 for a fresh start
    rows: list[dict[str, Any]]  # steps.jsonl's rows up to `step` (the record, trimmed to the checkpoint)
    history: list[dict[str, Any]]  # the checkpoint's epoch rows (metrics.jsonl)
    runs: Any  # tracker.py's TrackerRuns (it imports this module): which tracker run each tracker continues
    name: str  # the run's name in the trackers: its checkpoints folder's
    settings: dict[str, Any]  # the resolved settings
    facts: dict[str, str]  # the start-up table


class Sink(ABC):
    """One destination of the rows report/metrics.py builds, on rank 0. None may hold the training loop up: a sink
    that waits for a server sends from a thread of its own (MLflow) or another process (W&B)."""

    name: str  # where it writes, as the start-up table and a warning name it: a path, `--mlflow URI`

    def start(self, beginning: Beginning) -> None:  # noqa: B027 (a hook: nothing to do for most sinks)
        """Once, before the first step: continue where the checkpoint is. A UserError here ends the run."""

    @abstractmethod
    def step(self, row: dict[str, Any]) -> None:
        """A step row (metrics.step_row), at the log interval."""

    @abstractmethod
    def epoch(self, row: dict[str, Any]) -> None:
        """An epoch's row (metrics.epoch_row), at the step that ended the epoch (its `step`)."""

    def flush(self) -> None:  # noqa: B027 (ditto)
        """Before each checkpoint: what the checkpoint covers is on disk with it."""

    def close(self, finished: bool) -> None:  # noqa: B027 (ditto)
        """At the run's end; `finished`: it trained its last epoch."""

