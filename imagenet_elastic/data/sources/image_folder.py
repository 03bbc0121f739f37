"""Folders of image files (`folder:DIR`): class folders (torchvision's ImageFolder layout: DIR/CLASS/**/IMAGE), or a
flat folder whose classes a labels file gives (ImageNet's validation set as distributed, with --val-labels FILE).

Listing 1.28 M files costs minutes on a network file system at every restart, so the list is kept beside the
checkpoints with every walked folder's mtime (an added, removed or renamed file changes it) and re-read while they
hold. Nodes may each read their own copy at the same path, whose mtimes `rsync -a` or `cp -a` keep even where a file
is missing: the cache also holds the root's inode number, which a shared file system shows every node alike.

A labels file is a CSV of `filename,class` (a header line allowed: a first line naming no file and no class; the
filename with or without extension), or Kaggle's LOC_val_solution.csv (`ImageId,PredictionString`, first word the
class), naming every image of the folder by a class of the training split.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from imagenet_elastic.data.sources import index_file
from imagenet_elastic.data.sources.base import Source, shown, whose
from imagenet_elastic.errors import CorruptImageError, UserError

PREFIX = "folder"  # `folder:DIR` (sources.kind_of)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CACHE_VERSION = 3  # 2: the root folder's inode number; 3: hidden files and folders left out
CACHE_ARRAYS = ("root", "root_inode", "classes", "paths", "targets", "folders", "mtimes")
HEADER_WORDS = {"filename", "file", "image", "imageid", "image_id", "path", "name"}  # a labels file's first line


@dataclass(frozen=True)
class FilesUnder(Source):
    """Samples that are image files under a folder, at fixed-width relative paths: read with one open each."""

    root: str
    role: str
    classes: tuple[str, ...]
    paths: np.ndarray  # fixed-width bytes, relative to root: the names' bytes on disk (os.fsencode), UTF-8 or not
    labels: np.ndarray  # int64 class index per image

    def path(self, i: int) -> str:
        return os.path.join(self.root, os.fsdecode(self.paths[i]))

    def read(self, i: int) -> bytes:
        try:
            with open(self.path(i), "rb") as f:
                return f.read()
        except OSError as error:
            raise CorruptImageError(f"cannot read image file {self.name(i)}: {error.strerror or error}") from None

    def name(self, i: int) -> str:
        return shown(self.path(i))

    def where(self) -> str:
        return self.root

    def entries(self) -> np.ndarray:
        return self.paths


@dataclass(frozen=True)
class ImageFolder(FilesUnder):
    """Every image of one split's class folders, and the folders the scan walked (what tells the cache is current)."""

    folders: np.ndarray  # bytes, relative to root; b"." is root
    mtimes: np.ndarray  # their st_mtime_ns at scan time
    cached: bool = False  # read from the cache rather than scanned
    notes: tuple[str, ...] = ()

    def keep(self, cache_dir: str) -> None:
        if not self.cached:
            write_cache(self, cache_path(cache_dir, self.role))


def scan_image_folder(root: str, role: str) -> ImageFolder:
    """Index ROOT/CLASS/**/IMAGE; `role` ("train", "val") names the folder in errors."""
    if not os.path.isdir(root):
        raise UserError(f"{role} folder {root} does not exist")
    entries = [e for e in os.scandir(root) if not hidden(e.name)]
    dangling = next((e.path for e in entries if e.is_symlink() and not os.path.exists(e.path)), None)
    if dangling is not None:  # a class folder on a path not mounted here: its images would be left out, unsaid
        raise UserError(f"{role} folder {root}: {shown(dangling)} is a symbolic link to {os.readlink(dangling)}, "
                        "which does not exist")
    classes = sorted(e.name for e in entries if e.is_dir())
    if not classes:
        raise UserError(f"{role} folder {root} has no class folders (expected {root}/CLASS/IMAGE.jpg, or tar shards)")
    for name in classes:  # kept as text (checkpoints, exported models, classes.txt); image names are kept as bytes
        try:
            name.encode()
        except UnicodeEncodeError:
            raise UserError(f"class folder {shown(os.path.join(root, name))} has a name that is not UTF-8: rename "
                            "it (a class name is kept as text)") from None
    paths: list[str] = []
    labels: list[int] = []
    top = os.stat(root)
    folders = {".": top.st_mtime_ns}
    for label, name in enumerate(classes):
        found: list[str] = []
        try:
            _walk(root, name, folders, found, ((top.st_dev, top.st_ino),))
        except OSError as error:
            raise UserError(f"cannot scan {role} folder {shown(error.filename or root)}: "
                            f"{error.strerror or error}") from None
        if not found:
            raise UserError(f"class folder {os.path.join(root, name)} has no images")
        paths.extend(sorted(found))
        labels.extend([label] * len(found))
    return ImageFolder(root, role, tuple(classes), np.array([os.fsencode(p) for p in paths]),
                       np.array(labels, dtype=np.int64), np.array([os.fsencode(f) for f in folders]),
                       np.array(list(folders.values()), dtype=np.int64))


def _walk(root: str, relative: str, folders: dict[str, int], found: list[str], above: tuple[tuple[int, int], ...]
          ) -> None:
    """Images under ROOT/relative (symlinks followed; `above`: the folders this one is in, by device and inode, so
    that a link back up is refused, not followed forever); each folder's mtime is taken *before* it is listed, so a
    file added during the scan makes the cache look stale next time, never current."""
    path = os.path.join(root, relative)
    stat = os.stat(path)
    if (stat.st_dev, stat.st_ino) in above:
        raise UserError(f"{shown(path)} leads back to a folder it is in (a loop of symbolic links): remove the link")
    folders[relative] = stat.st_mtime_ns
    with os.scandir(path) as entries:
        for entry in entries:
            if hidden(entry.name):
                continue
            if entry.is_dir():
                _walk(root, os.path.join(relative, entry.name), folders, found, (*above, (stat.st_dev, stat.st_ino)))
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                found.append(os.path.join(relative, entry.name))


def hidden(name: str) -> bool:
    """A file or folder no split holds: macOS's ._x.jpg beside each image, .ipynb_checkpoints' copies."""
    return name.startswith(".")


def cache_path(cache_dir: str, role: str) -> str:
    return os.path.join(cache_dir, f"index-{role}.npz")


def claims(location: str, labels_file: Optional[str] = None) -> bool:
    return labels_file is not None or os.path.isdir(location)


def open_split(root: str, role: str, cache_dir: Optional[str], classes: Optional[tuple[str, ...]] = None,
               labels_file: Optional[str] = None) -> FilesUnder:
    """The cached list of `root` while it is current, else a fresh scan; with `labels_file`, the images it lists."""
    if labels_file is not None:
        return open_labelled(root, role, classes, labels_file)
    try:
        cached = read_cache(cache_path(cache_dir, role), root, role) if cache_dir else None
    except index_file.Unreadable as error:
        return replace(scan_image_folder(root, role), notes=(f"the file-list cache {error}: {root} was scanned "
                                                             "again",))
    return cached if cached is not None else scan_image_folder(root, role)


def write_cache(index: ImageFolder, path: str) -> None:
    index_file.write(path, CACHE_VERSION, root=np.array(os.path.abspath(index.root)),
                     root_inode=np.int64(os.stat(index.root).st_ino), classes=np.array(index.classes),
                     paths=index.paths, targets=index.labels, folders=index.folders, mtimes=index.mtimes)


def read_cache(path: str, root: str, role: str = "train") -> Optional[ImageFolder]:
    """None when the cache is missing, of another root, copy or version, or a folder changed; Unreadable if damaged."""
    saved = index_file.read(path, CACHE_VERSION, CACHE_ARRAYS)
    if saved is None:
        return None
    try:
        if str(saved["root"]) != os.path.abspath(root) or int(saved["root_inode"]) != os.stat(root).st_ino:
            return None
        for folder, mtime in zip(saved["folders"], saved["mtimes"]):
            if os.stat(os.path.join(root, os.fsdecode(folder))).st_mtime_ns != mtime:
                return None
    except OSError:  # a folder gone: scan again
        return None
    return ImageFolder(root, role, tuple(str(c) for c in saved["classes"]), saved["paths"], saved["targets"],
                       saved["folders"], saved["mtimes"], cached=True)


# ----------------------------------------------------------------------------- a flat folder and a labels file

@dataclass(frozen=True)
class LabelledFolder(FilesUnder):
    labels_file: str

    def where(self) -> str:
        return f"{self.root} (labels from {self.labels_file})"


def read_rows(labels_file: str) -> list[tuple[int, str, str]]:
    """(line, file name, class) of each row of the labels file."""
    try:
        with open(labels_file, newline="", encoding="utf-8-sig") as f:  # a BOM (a spreadsheet's export) is no text
            rows = list(csv.reader(f))
    except FileNotFoundError:
        raise UserError(f"--val-labels {labels_file} does not exist") from None
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise UserError(f"--val-labels {labels_file} cannot be read: {getattr(error, 'strerror', None) or error}") \
            from None
    found = []
    for line, row in enumerate(rows, start=1):
        cells = [cell.strip() for cell in row]
        if not any(cells) or (line == 1 and cells[0].lower() in HEADER_WORDS):
            continue
        if len(cells) < 2 or not cells[0] or not cells[1]:
            raise UserError(f"--val-labels {labels_file} line {line}: expected `filename,class`, got {','.join(row)!r}")
        found.append((line, cells[0], cells[1]))
    if not found:
        raise UserError(f"--val-labels {labels_file} lists no images")
    return found


def class_in(cell: str, classes: dict[str, int]) -> str:
    """The class a labels file's cell names: the whole cell ("golden retriever"), or its first word where only that
    is a class (LOC_val_solution.csv: the class, then its boxes)."""
    first = cell.split()[0]
    return cell if cell in classes or first not in classes else first


def open_labelled(location: str, role: str, classes: Optional[tuple[str, ...]], labels_file: str) -> LabelledFolder:
    if classes is None:
        raise UserError("--val-labels names the classes of a validation folder by the training set's classes")
    if not os.path.isdir(location):
        raise UserError(f"{role} folder {location} does not exist")
    files = {entry.name for entry in os.scandir(location) if entry.is_file() and not hidden(entry.name)}
    by_stem = {os.path.splitext(name)[0]: name for name in sorted(files, reverse=True)}  # the first by name wins
    number = {name: k for k, name in enumerate(classes)}
    chosen: dict[str, int] = {}
    for line, name, cell in read_rows(labels_file):
        file, label = name if name in files else by_stem.get(name), class_in(cell, number)
        if line == 1 and file is None and label not in number:  # a header line of any words
            continue
        if file is None:
            raise UserError(f"--val-labels {labels_file} line {line}: {name} is not in {location}")
        if label not in number:
            raise UserError(f"--val-labels {labels_file} line {line}: class {label!r} of {name} is not a class of "
                            f"{whose(classes)} ({len(classes)} classes, from {classes[0]!r} to {classes[-1]!r})")
        if file in chosen:
            raise UserError(f"--val-labels {labels_file} line {line}: {name} is listed twice")
        chosen[file] = number[label]
    images = sorted(name for name in files if name.lower().endswith(IMAGE_EXTENSIONS))
    unlisted = [name for name in images if name not in chosen]
    if unlisted:  # it would be left out of the scores without a word
        raise UserError(f"--val-labels {labels_file} gives no class to {len(unlisted)} of the {len(images)} images in "
                        f"{location}, the first {shown(unlisted[0])}")
    names = sorted(chosen)
    return LabelledFolder(location, role, classes, np.array([os.fsencode(n) for n in names]),
                          np.array([chosen[n] for n in names], dtype=np.int64), labels_file)
