"""A flat folder of images whose classes a labels file gives: ImageNet's validation set as it is distributed
(`ILSVRC2012_val_00000001.JPEG` ... in one folder) with `--val-labels FILE`. FILE is a CSV
of `filename,class` (a header line allowed; the filename with or without extension), or Kaggle's LOC_val_solution.csv
(`ImageId,PredictionString`, first word the class), with the training split's class names. The samples are the listed
files in name order; it must list every image of the folder.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from imagenet_elastic.data.sources.base import whose
from imagenet_elastic.data.sources.image_folder import IMAGE_EXTENSIONS, FilesUnder
from imagenet_elastic.errors import UserError

PREFIX = "folder"  # `folder:DIR` with --val-labels (sources.kind_of)
HEADER_WORDS = {"filename", "file", "image", "imageid", "image_id", "path", "name"}


@dataclass(frozen=True)
class LabelledFolder(FilesUnder):
    root: str
    role: str
    labels_file: str
    classes: tuple[str, ...]
    paths: np.ndarray  # fixed-width bytes: file names in root
    labels: np.ndarray  # int64

    def where(self) -> str:
        return f"{self.root} (labels from {self.labels_file})"


def read_rows(labels_file: str) -> list[tuple[int, str, str]]:
    """(line, file name, class) of each row of the labels file."""
    try:
        with open(labels_file, newline="") as f:
            rows = list(csv.reader(f))
    except FileNotFoundError:
        raise UserError(f"--val-labels {labels_file} does not exist") from None
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise UserError(f"--val-labels {labels_file} cannot be read: {getattr(error, 'strerror', None) or error}") \
            from None
    found = []
    for line, row in enumerate(rows, start=1):
        cells = [cell.strip() for cell in row]
        if not any(cells):
            continue
        if line == 1 and cells[0].lower() in HEADER_WORDS:
            continue
        if len(cells) < 2 or not cells[0] or not cells[1]:
            raise UserError(f"--val-labels {labels_file} line {line}: expected `filename,class`, got {','.join(row)!r}")
        found.append((line, cells[0], cells[1].split()[0]))  # LOC_val_solution: the class, then its boxes
    if not found:
        raise UserError(f"--val-labels {labels_file} lists no images")
    return found


def check_every_image_listed(files: set[str], listed: dict[str, int], location: str, labels_file: str) -> None:
    """An image of the folder that the labels file leaves out would be left out of the scores without a word."""
    images = sorted(name for name in files if name.lower().endswith(IMAGE_EXTENSIONS))
    unlisted = [name for name in images if name not in listed]
    if unlisted:
        raise UserError(f"--val-labels {labels_file} gives no class to {len(unlisted)} of the {len(images)} images in "
                        f"{location}, the first {unlisted[0]}")


def claims(location: str, labels_file: Optional[str]) -> bool:
    return labels_file is not None


def open_split(location: str, role: str, cache_dir: Optional[str], classes: Optional[tuple[str, ...]],
               labels_file: Optional[str]) -> LabelledFolder:
    if labels_file is None or classes is None:
        raise UserError("--val-labels names the classes of a validation folder by the training set's classes")
    if not os.path.isdir(location):
        raise UserError(f"{role} folder {location} does not exist")
    files = {entry.name for entry in os.scandir(location) if entry.is_file()}
    by_stem: dict[str, str] = {}
    for name in sorted(files):
        by_stem.setdefault(os.path.splitext(name)[0], name)
    number = {name: k for k, name in enumerate(classes)}
    chosen: dict[str, int] = {}
    for line, name, label in read_rows(labels_file):
        file = name if name in files else by_stem.get(name)
        if file is None:
            raise UserError(f"--val-labels {labels_file} line {line}: {name} is not in {location}")
        if label not in number:
            raise UserError(f"--val-labels {labels_file} line {line}: class {label!r} of {name} is not a class of "
                            f"{whose(classes)} ({len(classes)} classes, from {classes[0]!r} to {classes[-1]!r})")
        if file in chosen:
            raise UserError(f"--val-labels {labels_file} line {line}: {name} is listed twice")
        chosen[file] = number[label]
    check_every_image_listed(files, chosen, location, labels_file)
    names = sorted(chosen)
    return LabelledFolder(location, role, labels_file, classes, np.array([n.encode() for n in names]),
                          np.array([chosen[n] for n in names], dtype=np.int64))
