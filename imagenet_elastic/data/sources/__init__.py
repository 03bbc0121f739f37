"""Sources of samples: the forms a split of ImageNet is held in, behind one interface (base.Source).

    image_folder.py     DIR/CLASS/**/IMAGE, torchvision's ImageFolder layout
    tar_shards.py       a folder, brace pattern or glob of WebDataset tar shards (KEY.jpg + KEY.cls), indexed once
    labelled_folder.py  a flat folder of images with a labels file (ImageNet's original validation set)

`open_splits` turns the command line's DATA, --val-path and --val-labels into the train and val sources.
A new source is one module (a `Source` subclass, `claims` and `open_split`) and one entry in `KINDS`: nothing
downstream changes.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

from imagenet_elastic.data.sources import image_folder, labelled_folder, tar_shards
from imagenet_elastic.data.sources.base import FileList, Source
from imagenet_elastic.errors import UserError

# Each module has `claims(location, labels_file) -> bool` and `open_split(location, role, cache_dir, classes,
# labels_file) -> Source`. In the order they are asked: the first that claims a location opens it.
KINDS: tuple[ModuleType, ...] = (tar_shards, labelled_folder, image_folder)


def open_source(location: str, role: str, cache_dir: Optional[str], classes: Optional[tuple[str, ...]] = None,
                labels_file: Optional[str] = None) -> Source:
    """The source at `location`; `classes`: the training set's, for a split that names its labels by them (a
    labels file) or by number alone (shards without a classes file)."""
    for kind in KINDS:
        if kind.claims(location, labels_file):
            return kind.open_split(location, role, cache_dir, classes, labels_file)
    if not os.path.exists(location):
        what = "data folder" if role == "train" else "validation folder"
        raise UserError(f"{what} {location} does not exist" + ("; pass --val-path" if role == "val" else ""))
    raise UserError(f"{role} data {location} is neither a folder of class folders nor tar shards")


def train_location(data: str) -> str:
    """DATA/train, or the train shards of a folder of train and validation shards side by side (timm's
    imagenet-1k-wds), or DATA itself (a folder or a shard pattern)."""
    if tar_shards.is_pattern(data):
        return data
    if not os.path.isdir(data):
        raise UserError(f"data folder {data} does not exist")
    train = os.path.join(data, "train")
    if os.path.isdir(train):
        return train
    both = tar_shards.split_patterns(data)
    return both[0] if both else data


def split_locations(data: str, val_path: Optional[str]) -> tuple[str, str]:
    """DATA/train and DATA/val; DATA itself is the train split when it has no train/ (a folder or a shard
    pattern), and then --val-path names the val split."""
    train = train_location(data)
    if tar_shards.is_pattern(data) and val_path is None:
        raise UserError(f"DATA {data} is a shard pattern: pass --val-path for the validation split")
    both = None if val_path or tar_shards.is_pattern(data) else tar_shards.split_patterns(data)
    val = val_path or (both[1] if both else os.path.join(data, "val"))
    if not tar_shards.is_pattern(val) and not os.path.isdir(val):
        raise UserError(f"validation folder {val} does not exist" + ("" if val_path else "; pass --val-path"))
    return train, val


def open_splits(data: str, val_path: Optional[str], val_labels: Optional[str],
                cache_dir: Optional[str]) -> tuple[Source, Source]:
    """The train and val sources of a run, with the same classes (checked)."""
    train_location, val_location = split_locations(data, val_path)
    train = open_source(train_location, "train", cache_dir)
    val = open_source(val_location, "val", cache_dir, train.classes, val_labels)
    check_same_classes(train, val)
    return train, val


def check_same_classes(train: Source, val: Source) -> None:
    if train.classes == val.classes:
        return
    only_train = sorted(set(train.classes) - set(val.classes))[:5]
    only_val = sorted(set(val.classes) - set(train.classes))[:5]
    raise UserError(
        f"train ({train.where()}) and val ({val.where()}) classes differ: {len(train.classes)} vs "
        f"{len(val.classes)} classes; only in train: {only_train}, only in val: {only_val}"
    )


__all__ = ["KINDS", "FileList", "Source", "check_same_classes", "open_source", "open_splits",
           "split_locations", "train_location"]
