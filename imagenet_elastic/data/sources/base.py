"""What every source of samples gives the rest of the program, and nothing more. Per-sample data lives in numpy
arrays, not Python objects, so forked loader workers share the parent's pages (`bench/benchmark.py --mode index`);
files are opened in the process that reads them, when it first does.
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np

from imagenet_elastic.errors import UserError


@dataclass(frozen=True)
class FileList:
    """A split as the start-up check compares it across ranks: a few bytes whatever its size."""

    count: int
    classes: int
    digest: str


TRAINING_CLASSES = "the training split"


class Classes(tuple):
    """Class names that say whose they are (the training split's, the model's under `evaluate`), for label errors."""

    def __new__(cls, names: tuple[str, ...] = (), whose: str = TRAINING_CLASSES) -> Classes:
        made = super().__new__(cls, names)
        made.whose = whose
        return made


def shown(path: str) -> str:
    """`path` as a message prints it: a file name's bytes that are not UTF-8 (kept as surrogates by os.fsdecode, so
    that the file reopens) as `\\xff`, since a surrogate cannot be written to a UTF-8 stream or file."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def whose(classes: tuple[str, ...]) -> str:
    """Whose `classes` are, as a line names them: "the model", or (plain class names) "the training split"."""
    return getattr(classes, "whose", TRAINING_CLASSES)


class Source(abc.ABC):
    """The samples of one split. Subclasses set `role`, `classes` and `labels`."""

    role: str  # "train" or "val": how errors name the split
    classes: tuple[str, ...]
    labels: np.ndarray  # int64, one class index per sample
    cached: bool = False  # its list came from a cache rather than a scan (said in the start-up table)
    notes: tuple[str, ...] = ()  # warnings (a changed shard, a rebuilt cache) the run prints: sources have no console

    def __len__(self) -> int:
        return len(self.labels)

    def label(self, i: int) -> int:
        return int(self.labels[i])

    @abc.abstractmethod
    def read(self, i: int) -> bytes:
        """Sample i's encoded image (JPEG, PNG, ...); a CorruptImageError naming it when it cannot be read."""

    @abc.abstractmethod
    def name(self, i: int) -> str:
        """Sample i as a message names it: a file's path, a shard and its member."""

    @abc.abstractmethod
    def where(self) -> str:
        """Where the split lies (a folder, a shard pattern), for messages and the start-up table."""

    @abc.abstractmethod
    def entries(self) -> np.ndarray:
        """One entry per sample (bytes), equal on two nodes exactly when they hold the same sample there (a relative
        path, a shard and member); the start-up check names the first that departs from rank 0's."""

    def sample_columns(self) -> tuple[np.ndarray, ...]:
        """Arrays of one entry per sample that together say what each sample is, wherever the data lies: what a
        checkpoint's fingerprint is taken of. Sources whose entries are built per call override it."""
        return self.entries(), self.labels

    def fingerprint(self) -> FileList:
        """Equal data gives equal digests wherever it lies; sources may hash cheaper arrays they already hold."""
        return FileList(len(self), len(self.classes), digest_of(self.classes, self.entries(), self.labels))

    def describe(self) -> str:
        """The start-up table's line."""
        return f"{len(self)} in {self.where()}" + (" (file list from the cache)" if self.cached else "")

    def keep(self, cache_dir: str) -> None:  # noqa: B027 (most sources have nothing to keep)
        """Rank 0, once every rank agreed on the data: save what makes the next start faster (OSError: a warning)."""


def digest_of(classes: tuple[str, ...], *arrays: np.ndarray) -> str:
    """A digest of class names and arrays, of their bytes: equal arrays of one dtype give equal bytes (fixed-width
    strings take the longest entry's width)."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update("\0".join(classes).encode() + b"\1")
    for array in arrays:
        digest.update(str(array.dtype).encode() + b"\1")
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def checked_classes(labels: np.ndarray, label_of: Callable[[int], str], named: Optional[tuple[str, ...]],
                    classes: Optional[tuple[str, ...]], named_by: str, unnamed: str) -> tuple[str, ...]:
    """The class names of `labels`: the data's own `named` (`named_by`: how an error says so), else the training
    split's `classes`, else the numbers 0..N-1, which must leave no gap (`unnamed`: the data that names none, and how
    it would): one stray label (99 among 0..9) would make a model of 100 classes, 90 without a sample, and a stray
    10**9 would not fit in memory as names. `label_of(i)` names sample i's label for the first one that is refused."""
    if not named and not classes:
        used = np.unique(labels)
        missing = np.flatnonzero(used != np.arange(len(used)))
        if len(used) and used[0] >= 0 and len(missing):  # a negative label is the range check's
            gap, after = int(missing[0]), int(used[missing[0]])  # the first label unused, the first used past it
            unused = str(gap) if after == gap + 1 else f"{gap}..{after - 1}"
            raise UserError(f"{label_of(int(np.flatnonzero(labels == after)[0]))} leaves labels {unused} unused; "
                            f"{unnamed} must number their classes 0..N-1 without gaps")
    known = named or classes or tuple(str(c) for c in range(max(0, int(labels.max())) + 1))
    check_range(labels, label_of, len(known), named_by if named else f"{whose(classes)} has" if classes else "")
    return known


def check_range(labels: np.ndarray, label_of: Callable[[int], str], count: int, bound: str) -> None:
    """Every label names one of `count` classes; `bound`: whose they are, as the error says (`the files name`)."""
    bad = np.flatnonzero((labels < 0) | (labels >= count))
    if len(bad):
        raise UserError(f"{label_of(int(bad[0]))} is out of range" + (f": {bound} {count} classes" if bound else ""))
