"""A record of which samples each step trained on, for proving that no sample is lost or repeated: with
IMAGENET_ELASTIC_SAMPLE_LOG=DIR every rank appends one JSON line per optimizer step to its own file in DIR.
Steps rolled back by a crash and trained again appear more than once; `coverage` merges them."""

from __future__ import annotations

import glob
import itertools
import json
import os
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Optional

from imagenet_elastic.atomic_files import nearest_existing
from imagenet_elastic.errors import UserError
from imagenet_elastic.report import metrics

ENV_VAR = "IMAGENET_ELASTIC_SAMPLE_LOG"


class SampleLog:
    def __init__(self, folder: Optional[str], rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.writer = uuid.uuid4().hex[:12]  # one per process and round: tells attempts of a step apart
        self.file: Optional[IO[str]] = open_log(folder, f"rank{rank}-{self.writer}.jsonl") if folder else None

    def record(self, epoch: int, step: int, samples: Iterable[int]) -> None:
        if self.file is not None:
            row = {"epoch": epoch, "step": step, "rank": self.rank, "world_size": self.world_size,
                   "writer": self.writer, "time": time.time(), "samples": [int(i) for i in samples]}
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class SampleLogError(UserError):
    """The variable's folder cannot take this rank's log: said once by each node, whose ranks share its disks."""

    every_node = True


def check_folder(folder: Optional[str]) -> None:
    """The variable's FOLDER, checked with the run's other inputs (before the data scan), making nothing: its
    nearest existing part must be a folder this process may write in (open_log makes the rest at the first step)."""
    if not folder:
        return
    path = nearest_existing(folder)
    if not os.path.isdir(path):
        raise SampleLogError(f"{ENV_VAR}={folder}: cannot log samples there: {path} is not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SampleLogError(f"{ENV_VAR}={folder}: cannot log samples there: {path} is not writable")


def open_log(folder: str, name: str) -> IO[str]:
    """FOLDER/NAME, a file of its own beside the logs of earlier runs, which it never touches. FOLDER must be a
    folder (made if missing): an existing file there is refused, not replaced or appended to."""
    try:
        os.makedirs(folder, exist_ok=True)
        return open(os.path.join(folder, name), "a")  # noqa: SIM115 (open for the whole run, closed by close())
    except OSError as error:
        why = "a file, not a folder" if os.path.exists(folder) and not os.path.isdir(folder) else error.strerror
        raise SampleLogError(f"{ENV_VAR}={folder}: cannot log samples there: {why or error}") from None


@dataclass(frozen=True)
class Coverage:
    epochs: int
    steps: int
    samples_trained: int  # distinct (epoch, sample) pairs in the final training
    samples_lost: int  # expected but never trained
    samples_repeated: int  # trained by two different steps of one epoch
    steps_redone: int  # steps trained again after a rollback (work lost, not samples)
    world_sizes: tuple[int, ...]  # as the run went, one entry per change


def read(folder: str) -> list[dict]:
    return [row for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))) for row in metrics.read(path)]


def coverage(folder: str, samples_per_epoch: int, global_batch: int) -> Coverage:
    """Merge the ranks' records: a step's samples are the union over the ranks (and over the attempts, which must
    agree); an epoch must cover `samples_per_epoch` distinct samples, each in one step."""
    rows = read(folder)
    by_step: dict[tuple[int, int], set[int]] = defaultdict(set)
    writers: dict[tuple[int, int], set[str]] = defaultdict(set)
    world: dict[tuple[int, int], int] = {}
    for row in rows:
        key = row["epoch"], row["step"]
        by_step[key].update(row["samples"])
        writers[key].add(row["writer"])
        world[key] = max(world.get(key, 0), row["world_size"])
    epochs: dict[int, Counter] = defaultdict(Counter)
    for (epoch, _), samples in by_step.items():
        if len(samples) != global_batch:
            raise AssertionError(f"epoch {epoch}: a step trained {len(samples)} distinct samples, not {global_batch}")
        epochs[epoch].update(samples)
    lost = sum(samples_per_epoch - len(counts) for counts in epochs.values())
    repeated = sum(n - 1 for counts in epochs.values() for n in counts.values() if n > 1)
    redone = sum(len(names) > world[key] for key, names in writers.items())
    ordered = sorted(rows, key=lambda r: r["time"])
    worlds = tuple(size for size, _ in itertools.groupby(r["world_size"] for r in ordered))
    return Coverage(epochs=len(epochs), steps=len(by_step), samples_trained=sum(len(c) for c in epochs.values()),
                    samples_lost=lost, samples_repeated=repeated, steps_redone=redone, world_sizes=worlds)
