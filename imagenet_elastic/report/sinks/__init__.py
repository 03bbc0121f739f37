"""Where a run's rows go: steps.jsonl, TensorBoard and the experiment trackers, each a `Sink` (base.py), behind one
container the trainer holds (`Sinks`). metrics.jsonl is the checkpointer's to write."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any, Callable, Optional

from imagenet_elastic import options
from imagenet_elastic.errors import UserError, one_line
from imagenet_elastic.options import option
from imagenet_elastic.report.sinks import steps_file
from imagenet_elastic.report.sinks.base import Beginning, Sink
from imagenet_elastic.report.sinks.mlflow_tracker import MlflowTracker
from imagenet_elastic.report.sinks.steps_file import StepsFile
from imagenet_elastic.report.sinks.tensorboard_events import TensorBoard
from imagenet_elastic.report.sinks.tracker import Tracker, TrackerRuns
from imagenet_elastic.report.sinks.wandb_tracker import WandbTracker

TRACKERS: dict[str, type[Tracker]] = {cls.option: cls for cls in (WandbTracker, MlflowTracker)}


def tracker_settings(trackers: dict[str, type[Tracker]]) -> type:
    """Each tracker's setting (`--wandb PROJECT`), as its class describes it (help, metavar)."""
    fields = [(name, Optional[str], option(None, cls.help, "run", cls.metavar)) for name, cls in trackers.items()]
    return dataclasses.make_dataclass("TrackerSettings", fields, frozen=True)


TrackerSettings = tracker_settings(TRACKERS)


@dataclasses.dataclass(frozen=True)
class ReportSettings(TrackerSettings):
    """Where a run's rows go besides metrics.jsonl: steps.jsonl, TensorBoard, and each tracker of `TRACKERS`."""

    log_interval: int = option(50, "steps between progress lines (when the output is not a terminal) and rows of "
                               "`steps.jsonl` and TensorBoard", "run", "N", type=options.step_count)
    tensorboard: Optional[bool] = option(
        None, "rank 0 writes per-step and per-epoch scalars to CHECKPOINTS/tensorboard (`pip install "
        "\"imagenet_elastic[tensorboard]\"`); resumed runs continue the same curves", "run",
        shown_default="when installed", action=argparse.BooleanOptionalAction)


def installed(package: str, option: Optional[str] = None) -> bool:
    """Whether `package` can be imported, once the None cli.program left in sys.modules for it is removed; where
    `option` (the setting and its extra) asks for it, a UserError if not."""
    if sys.modules.get(package, False) is None:
        del sys.modules[package]
    found = importlib.util.find_spec(package) is not None
    if option and not found:
        raise UserError(f'--{option} needs the {package} package: pip install "imagenet_elastic[{option}]"')
    return found


def tensorboard_wanted(setting: Optional[bool]) -> bool:
    """--tensorboard: always (an error without the package); --no-tensorboard: never; neither: when installed."""
    return setting is not False and installed("tensorboard", "tensorboard" if setting else None)


def chosen(config: Any, is_main: bool) -> list[Sink]:
    """Rank 0's sinks (none on other ranks): steps.jsonl always, and those the settings name, each checked before
    anything starts (no thread, no worker); a setting a sink cannot use is a UserError."""
    tensorboard = tensorboard_wanted(config.tensorboard)  # on every rank: each says the same line
    if not is_main:
        return []
    folder = config.checkpoints_path
    trackers = [cls(getattr(config, opt), folder) for opt, cls in TRACKERS.items() if getattr(config, opt) is not None]
    for tracker in trackers:
        installed(tracker.package, tracker.option)
        tracker.check()
    return [StepsFile(folder), *([TensorBoard(folder)] if tensorboard else []), *trackers]


class Sinks:
    """The sinks the trainer holds (`chosen`), called in turn. A sink that raises (a full disk, a server gone) is
    warned about once and left out, and training goes on; a UserError (the settings' mistake) ends the run."""

    def __init__(self, sinks: Sequence[Sink], folder: str, warn: Callable[[str], None]) -> None:
        self.sinks, self.folder, self.warn = list(sinks), folder, warn
        self.runs = TrackerRuns(folder, warn)

    def start(self, step: int, history: list[dict[str, Any]], saved_runs: dict[str, str], continuing: bool,
              started_from: Optional[float], name: str, settings: dict[str, Any], facts: dict[str, str]) -> None:
        """Before the first step (rank 0, through distributed.rank_0_does): steps.jsonl loses its rows beyond `step`,
        then each sink starts from there. Trackers continue `saved_runs`, else, when `continuing` the folder, the runs
        a start from the same checkpoint (`started_from`, its time stamp) made: see tracker.py."""
        if not self.sinks:
            return
        self.runs.begin(saved_runs, continuing, started_from)
        rows = steps_file.trim(self.folder, step, self.warn)
        beginning = Beginning(step, rows, history, self.runs, name, settings, facts)
        self.each(lambda sink: sink.start(beginning))

    def step(self, row: dict[str, Any]) -> None:
        self.each(lambda sink: sink.step(row))

    def epoch(self, row: dict[str, Any]) -> None:
        self.each(lambda sink: sink.epoch(row))

    def flush(self) -> None:
        self.each(lambda sink: sink.flush())

    def close(self, finished: bool) -> None:
        self.each(lambda sink: sink.close(finished), closing=True)
        self.sinks = []

    @property
    def tracker_runs(self) -> dict[str, str]:
        """What checkpoints save: option -> the tracker run this training run is (also of a tracker that failed)."""
        return dict(self.runs.ids)

    def each(self, action: Callable[[Sink], None], closing: bool = False) -> None:
        for sink in list(self.sinks):
            try:
                action(sink)
            except UserError:
                raise
            except Exception as error:  # the disk filled, the server went away: the run goes on without it
                self.sinks.remove(sink)
                self.warn(f"{sink.name} failed, training goes on without it: {one_line(error)}")
                if not closing:
                    with contextlib.suppress(Exception):  # it has failed once already, and said so
                        sink.close(finished=False)
