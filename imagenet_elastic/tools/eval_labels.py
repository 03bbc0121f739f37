"""The labels `imagenet-elastic evaluate` scores against: each VAL's classes as the model's outputs (by name, or
numbered folders), --class-subset's scored classes, and ReaL's labels."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from imagenet_elastic.data.sources.base import Source
from imagenet_elastic.errors import UserError, counted

REAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})")
REAL_ENTRIES = 50_000  # real.json's: one per image of ImageNet's validation set, in the order of their names


class Relabelled(Source):
    """A validation source whose labels are positions in the scored classes (the model's, or a subset of them)."""

    def __init__(self, source: Source, labels: np.ndarray, classes: tuple[str, ...]) -> None:
        self.source, self.labels, self.classes, self.role = source, labels, classes, "val"

    def read(self, i: int) -> bytes:
        return self.source.read(i)

    def name(self, i: int) -> str:
        return self.source.name(i)

    def where(self) -> str:
        return self.source.where()

    def entries(self) -> np.ndarray:
        return self.source.entries()


def model_index(source: Source, classes: tuple[str, ...], where: str) -> np.ndarray:
    """Each of the source's classes as the model's output index: by name, or by number for folders numbered 0..N-1
    (ImageNet-V2's: folder 0 is the model's class 0)."""
    if tuple(source.classes) == tuple(classes):  # the model's own list, its repeated names too (ImageNet's two cranes)
        return np.arange(len(classes), dtype=np.int64)
    index = {name: k for k, name in enumerate(classes)}
    if all(name in index for name in source.classes):
        twice = next((name for name in source.classes if classes.count(name) > 1), None)
        if twice is not None:
            raise UserError(f"VAL {where}: its class {twice!r} is more than one of the model's classes (at "
                            f"{', '.join(str(k) for k, name in enumerate(classes) if name == twice)}): a VAL whose "
                            "classes are matched by name needs names the model does not repeat")
        return np.array([index[name] for name in source.classes], dtype=np.int64)
    if all(name.isdigit() for name in source.classes):
        numbers = np.array([int(name) for name in source.classes], dtype=np.int64)
        if numbers.max() >= len(classes):
            raise UserError(f"VAL {where}: class folder {numbers.max()} is beyond the model's {len(classes)} classes")
        return numbers
    unknown = [name for name in source.classes if name not in index]
    raise UserError(f"VAL {where}: {len(unknown)} class(es) the model does not have, e.g. {unknown[:3]} (the model's "
                    f"classes run from {classes[0]!r} to {classes[-1]!r})")


def read_subset(path: str, classes: tuple[str, ...]) -> np.ndarray:
    """--class-subset: the model's output indices of the names the file lists, in the model's order."""
    index = {name: k for k, name in enumerate(classes)}
    lines = read_file("--class-subset", path, lambda f: f.read().splitlines(), "cannot be read")
    names = [line.strip() for line in lines]
    for number, name in enumerate(names, start=1):
        if name and name not in index:
            raise UserError(f"--class-subset {path} line {number}: {name!r} is not a class of the model "
                            f"({len(classes)} classes, from {classes[0]!r} to {classes[-1]!r})")
    chosen = sorted({index[name] for name in names if name})
    if not chosen:
        raise UserError(f"--class-subset {path} names no class")
    return np.array(chosen, dtype=np.int64)


def read_file(option: str, path: str, read: Callable[[TextIO], Any], failing: str) -> Any:
    """What `read` makes of an option's file, or a UserError saying why it cannot (`failing`: how it cannot)."""
    try:
        with open(path) as f:
            return read(f)
    except FileNotFoundError:
        raise UserError(f"{option} {path} does not exist") from None
    except (OSError, ValueError) as error:  # ValueError: UnicodeDecodeError, JSONDecodeError
        raise UserError(f"{option} {path} {failing}: {getattr(error, 'strerror', None) or error}") from None


def read_real_labels(path: str) -> list[list[int]]:
    real = read_file("--real-labels", path, json.load, "is not a JSON file")
    # JSON's true and false are Python's bools, which are ints
    if not isinstance(real, list) or not all(isinstance(labels, list) and all(type(k) is int for k in labels)
                                            for labels in real):
        raise UserError(f"--real-labels {path} is not a list of lists of class numbers (ReaL's real.json)")
    if not real:
        raise UserError(f"--real-labels {path} is an empty list: ReaL's real.json has an entry per image")
    if len(real) > REAL_ENTRIES:
        raise UserError(f"--real-labels {path} has {len(real)} entries, ReaL's real.json {REAL_ENTRIES} (one per "
                        f"image of ImageNet's validation set): entry {REAL_ENTRIES + 1} and on name no image")
    return real


def check_real_classes(real: list[list[int]], path: str, classes: int) -> None:
    """Every class number of real.json is one of the model's (a number beyond them would be dropped unseen)."""
    for number, labels in enumerate(real, start=1):
        outside = [k for k in labels if not 0 <= k < classes]
        if outside:
            raise UserError(f"--real-labels {path} entry {number} (ILSVRC2012_val_{number:08d}): class {outside[0]} "
                            f"is out of range: the model has {classes} classes")


def real_sets(source: Source, real: list[list[int]], path: str, position: np.ndarray) -> list[frozenset[int]]:
    """Each image's real labels, as positions among the scored classes (`position`: each of the model's classes',
    -1 where it is not scored: a label outside them cannot be predicted)."""
    found = []
    for i in range(len(source)):
        match = REAL_NAME.search(os.path.basename(source.name(i)))
        if match is None:
            raise UserError(f"--real-labels: {source.name(i)} is not named as ImageNet's validation images "
                            "(ILSVRC2012_val_NNNNNNNN), so it has no entry in " + path)
        number = int(match.group(1))
        if not 1 <= number <= len(real):
            raise UserError(f"--real-labels {path} has {counted(len(real), 'entry', 'entries')}: none for "
                            f"{source.name(i)}")
        found.append(frozenset(int(position[k]) for k in real[number - 1] if position[k] >= 0))
    return found


def real_counts(sets: list[frozenset[int]]) -> Any:
    """ReaL's sums per batch: images right, images counted (a non-empty list of real labels)."""
    import torch

    from imagenet_elastic.train.step import Counts

    def count(logits: torch.Tensor, batch: Any) -> torch.Tensor:
        top1 = logits.argmax(1).tolist()
        rows = [sets[i] for i in batch.indices.tolist()]
        right = sum(1 for guess, labels in zip(top1, rows) if labels and guess in labels)
        return torch.tensor([right, sum(1 for labels in rows if labels)], dtype=torch.float64)

    return Counts(("real_right", "real_images"), count)
