"""Sources of samples: the forms a split of ImageNet is held in, behind one interface (base.Source).

A prefix (`wds:`, `parquet:`, `folder:`) names a location's kind before any look at the file system, as timm's reader
factory does; else the first kind in `KINDS` that claims it opens it (a store's URL: tar_shards). A kind is a module
with PREFIX, `claims(location, labels_file) -> bool` and `open_split(location, role, cache_dir, classes, labels_file)
-> Source`, and optionally `is_pattern(location) -> bool` (a location of its files that is not a folder) and
`split_folder(folder) -> (train, val) or None` (a folder of both splits, told apart by file names).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

from imagenet_elastic.data.sources import image_folder, object_store, parquet, tar_shards
from imagenet_elastic.data.sources.base import FileList, Source
from imagenet_elastic.errors import UserError
from imagenet_elastic.options import option

# The first that claims a location opens it (parquet before tar shards: a `*.parquet` glob is a pattern to both).
KINDS: tuple[ModuleType, ...] = (parquet, tar_shards, image_folder)
_PREFIXED = re.compile(r"([a-z][a-z0-9+.-]*):(?!//)(.*)", re.DOTALL)  # `wds:/data`, not `s3://bucket`
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*://")


@dataclass(frozen=True)
class SourceSettings:
    """Where the run's samples are: the data root or the train split, and the validation split."""

    data: str = field(metadata={"help": "a root with `train/` and `val/`, each class folders (ImageFolder) or tar "
                                        "shards (`imagenet-elastic pack`, WebDataset); a folder of Hugging Face "
                                        "parquet files; or the train split itself: a folder, a shard pattern "
                                        "(`shards-{0000..1023}.tar`) or a glob. A prefix (`folder:`, `wds:`, "
                                        "`parquet:`) names the form",
                                "metavar": "DATA", "positional": True})
    val_path: Optional[str] = option(None, "the validation split: class folders, tar shards (a folder or a pattern), "
                                     "parquet files, or a flat folder of images with --val-labels", "run", "PATH",
                                     shown_default="`DATA/val`")
    val_labels: Optional[str] = option(
        None, "the classes of a flat --val-path folder: a CSV of `filename,class` (class = a training class name) or "
        "ImageNet's LOC_val_solution.csv", "run", "FILE")


def prefixes() -> list[str]:
    return sorted({kind.PREFIX for kind in KINDS})


def kind_of(location: str) -> tuple[Optional[str], str]:
    """(the prefix naming the location's kind, or None, and the location without it). A word and a colon that name
    no kind are part of a path (`run:2/data`), unless nothing is there; a URL is refused."""
    match = _PREFIXED.fullmatch(location)
    if match and match.group(1) in prefixes():
        return match.group(1), match.group(2)
    if object_store.is_url(location):
        return None, location
    if (match or _SCHEME.match(location)) and not os.path.exists(location):
        known = ", ".join(f"{p}:" for p in prefixes())
        schemes = ", ".join(f"{s}://" for s in object_store.SCHEMES)
        raise UserError(f"no source reads {location}: a location is a path, a path after one of {known}, or a "
                        f"store's URL ({schemes})")
    return None, location


def _isdir(path: str) -> bool:
    """A folder on disk, or a prefix with objects under it in a store."""
    if not object_store.is_url(path):
        return os.path.isdir(path)
    if object_store.scheme(path) in ("http", "https"):  # nothing to list: a folder there is a pack's, or a split of it
        return any(object_store.find(object_store.join(path, *parts))
                   for parts in ((tar_shards.INDEX_NAME,), ("train", tar_shards.INDEX_NAME)))
    return object_store.isdir(path)


def prefixed(prefix: Optional[str], location: str) -> str:
    return f"{prefix}:{location}" if prefix else location


def candidates(prefix: Optional[str]) -> tuple[ModuleType, ...]:
    return tuple(kind for kind in KINDS if prefix is None or prefix == kind.PREFIX)


def is_pattern(location: str) -> bool:
    """A location of files that is not a folder: a shard or parquet pattern, or one such file."""
    prefix, path = kind_of(location)
    return any(getattr(kind, "is_pattern", lambda _: False)(path) for kind in candidates(prefix))


def both_splits(data: str) -> Optional[tuple[str, str]]:
    """The train and val locations of a folder holding both side by side, told apart by file names; else None."""
    prefix, path = kind_of(data)
    for kind in candidates(prefix):
        found = getattr(kind, "split_folder", lambda _: None)(path)
        if found:
            return prefixed(prefix, found[0]), prefixed(prefix, found[1])
    return None


def open_source(location: str, role: str, cache_dir: Optional[str], classes: Optional[tuple[str, ...]] = None,
                labels_file: Optional[str] = None) -> Source:
    """The source at `location`; `classes`: the training split's, for a split that names its labels by them or by
    number alone. A prefixed location is opened by its kind whatever is there: its own errors say what is wrong."""
    prefix, path = kind_of(location)
    kinds = candidates(prefix)
    if object_store.is_url(path) and tar_shards not in kinds:
        raise UserError(f"{location}: a store holds tar shards (a pack, or WebDataset shards) for training here; "
                        f"no {prefix}: source reads a store")
    for kind in kinds:
        if kind.claims(path, labels_file):
            return kind.open_split(path, role, cache_dir, classes, labels_file)
    if prefix is not None:  # none of the prefix's kinds claims it: the last (the most general) says why
        return kinds[-1].open_split(path, role, cache_dir, classes, labels_file)
    if not os.path.exists(location):
        what = "data folder" if role == "train" else "validation folder"
        raise UserError(f"{what} {location} does not exist" + ("; pass --val-path" if role == "val" else ""))
    raise UserError(f"{role} data {location} is neither a folder of class folders, tar shards nor parquet files")


def train_location(data: str) -> str:
    """DATA/train, the train split of a folder of both splits side by side, or DATA itself (a folder or a pattern)."""
    if is_pattern(data):
        return data
    prefix, path = kind_of(data)
    if not _isdir(path):
        if os.path.exists(path):
            raise UserError(f"DATA {path} is a file: DATA is a folder (a root with train/ and val/, or the train "
                            "split's class folders, tar shards or parquet files), a shard pattern "
                            "(`shards-{0000..1023}.tar`), a glob, or one shard or parquet file")
        raise UserError(f"data folder {path} does not exist")
    train = os.path.join(path, "train")
    if _isdir(train):
        check_train_folder(path, train)
        return prefixed(prefix, train)
    both = both_splits(data)
    return both[0] if both else data


def check_train_folder(data: str, train: str) -> None:
    """DATA/train of files alone beside other folders is a class named `train` among class folders, not the train
    split of a root: refused, as a root would train on that one class."""
    if object_store.is_url(data) or not flat_folder(train):
        return
    others = sorted(e.name for e in os.scandir(data) if e.is_dir() and e.name not in ("train", "val")
                    and not image_folder.hidden(e.name))
    if others:
        raise UserError(f"DATA {data}: {train} holds files alone, no class folders, beside class folders "
                        f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): a class named `train` makes "
                        "DATA look like a root with a train split; rename that class folder")


def split_locations(data: str, val_path: Optional[str]) -> tuple[str, str]:
    """DATA/train and DATA/val; DATA itself is the train split when it has no train/, and --val-path the val split."""
    train = train_location(data)
    if is_pattern(data) and val_path is None:
        raise UserError(f"DATA {data} is a pattern of files: pass --val-path for the validation split")
    prefix, path = kind_of(data)
    both = None if val_path else both_splits(data)
    val = val_path or (both[1] if both else prefixed(prefix, os.path.join(path, "val")))
    folder = kind_of(val)[1]
    if not is_pattern(val) and not _isdir(folder):
        raise UserError(f"validation folder {folder} does not exist" + ("" if val_path else "; pass --val-path"))
    return train, val


def flat_folder(path: str) -> bool:
    """A folder of files alone, none of them shards or parquet files: a flat split's images, or one class's."""
    return os.path.isdir(path) and not (tar_shards.claims(path) or parquet.claims(path)) and not any(
        entry.is_dir() and not image_folder.hidden(entry.name) for entry in os.scandir(path))


def evaluated_split(location: str, labels_file: Optional[str] = None) -> str:
    """The split `evaluate` scores for VAL `location`: a data root's (a folder holding train/, or val/ alone) DATA/val,
    as training takes it, else `location`: a split of class folders may have a class named `val`, among others or
    alone (val/ holding images alone, without a `labels_file` that would make it a flat split)."""
    prefix, path = kind_of(location)
    val = os.path.join(path, "val")
    if _isdir(os.path.join(path, "train")):
        if not _isdir(val):
            raise UserError(f"VAL {location} is a data root (it holds train/) without val/: name the validation split")
        return prefixed(prefix, val)
    if not _isdir(val):
        return location
    if object_store.is_url(path):  # a store's folder holds shards, never class folders
        return prefixed(prefix, val)
    folders = [entry.name for entry in os.scandir(path) if entry.is_dir() and not image_folder.hidden(entry.name)]
    one_class = labels_file is None and flat_folder(val)
    return prefixed(prefix, val) if folders == ["val"] and not one_class else location


def open_splits(data: str, val_path: Optional[str], val_labels: Optional[str],
                cache_dir: Optional[str]) -> tuple[Source, Source]:
    """A run's train and val sources, their classes checked equal; `cache_dir`: where indexes are kept (not a split)."""
    train_location, val_location = split_locations(data, val_path)
    if cache_dir is not None:
        check_apart(cache_dir, "--checkpoints-path", (train_location, val_location))
    train = open_source(train_location, "train", cache_dir)
    val = open_source(val_location, "val", cache_dir, train.classes, val_labels)
    check_same_classes(train, val)
    check_val_apart(train, val)
    return train, val


def split_files(source: Source) -> set[str]:
    """The parquet files or shards a split reads, by real path (a folder of images: none)."""
    files = getattr(source, "files", None) or getattr(source, "shards", ())
    return {f if object_store.is_url(f) else os.path.realpath(f) for f in files}


def check_val_apart(train: Source, val: Source) -> None:
    """A training split holding the validation split's files among others (a folder taken whole where its file names
    did not say which is which) is refused: it would train on what it is scored on. The very same files are meant."""
    train_files, val_files = split_files(train), split_files(val)
    shared = sorted(train_files & val_files)
    if shared and train_files != val_files:
        raise UserError(f"the train split ({train.where()}) holds {shared[0]}, a file of the val split "
                        f"({val.where()}): name the training files with a pattern")


def check_apart(folder: str, what: str, splits: tuple[str, str], containing: bool = False) -> None:
    """Refuse a folder written to that is (or lies inside, or with `containing` holds) a split's folder on disk, whose
    samples what is written there would join or break at the next start (a pattern's or a URL's cannot)."""
    if object_store.is_url(folder):
        return
    real = os.path.realpath(folder)
    for role, location in zip(("train", "val"), splits):
        path = kind_of(location)[1]
        if is_pattern(location) or object_store.is_url(path):
            continue
        split = os.path.realpath(path)
        common = os.path.commonpath((real, split))
        if common == split or (containing and common == real):
            how = "is" if real == split else "lies inside" if common == split else "holds"
            raise UserError(f"{what} {folder} {how} the {role} split {path}: what is written there would be read "
                            "with it; choose a folder outside the data")


def check_same_classes(train: Source, val: Source) -> None:
    if tuple(train.classes) == tuple(val.classes):
        return
    only_train = sorted(set(train.classes) - set(val.classes))[:5]
    only_val = sorted(set(val.classes) - set(train.classes))[:5]
    if not (only_train or only_val) and len(train.classes) == len(val.classes):  # the names alike, not their labels
        k = next(k for k, (a, b) in enumerate(zip(train.classes, val.classes)) if a != b)
        raise UserError(f"train ({train.where()}) and val ({val.where()}) name the same {len(train.classes)} classes "
                        f"in another order: label {k} is {train.classes[k]!r} in train, {val.classes[k]!r} in val")
    raise UserError(f"train ({train.where()}) and val ({val.where()}) classes differ: {len(train.classes)} vs "
                    f"{len(val.classes)} classes; only in train: {only_train}, only in val: {only_val}")


is_url = object_store.is_url

__all__ = ["KINDS", "FileList", "Source", "both_splits", "check_apart", "check_same_classes", "evaluated_split",
           "flat_folder", "is_pattern", "is_url", "kind_of", "open_source", "open_splits", "split_locations",
           "train_location"]
