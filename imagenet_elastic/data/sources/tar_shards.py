"""Tar shards in WebDataset's layout: each sample is consecutive members `KEY.jpg` (or .jpeg, .png, .webp) and
`KEY.cls` (the label as a decimal integer), where KEY is the member's name up to the first dot of its last
part, as WebDataset and timm's imagenet-1k-wds shards have them.

A split is a folder of `*.tar` files (sorted by name), or a brace or glob pattern
(`/data/imagenet-train-{000000..001023}.tar`). The first start walks every shard once and keeps an index: for
each sample its shard, the offset and length of its image bytes, its label and a CRC-32 of its image bytes, in numpy
arrays (32 bytes a sample: 39 MB for ImageNet's 1.28 M images, shared by forked loader workers; docs/BENCHMARKS.md).
`imagenet-elastic pack` writes that index beside its shards (INDEX_NAME, written last); shards from elsewhere are
indexed at the first start and the index is kept in the checkpoints folder. Either is checked against its shards at
every start (`tar_check.check_shards`): a pack's shard changed since is refused, one from elsewhere is indexed again,
said; and every read checks its sample's checksum (tar_index.py), which sees the bytes changed in place that sizes,
mtimes and headers cannot.

Reading sample i maps its shard (once per process, lazily: a loader worker maps what it reads) and copies the
sample's bytes out of the mapping: no open, no seek, no directory lookup per sample, and any sample at any
moment, so the world-size-invariant sampler, step-exact resume and --ra-reps work as with a folder of files.
Class names come from a `classes.txt` (one per line, in label order) in the shards' folder or the one above
it, or a `class_names` list in an `_info.json` there; without either the labels are the names ("0", "1", ...),
or the training split's classes for a val split. A folder that holds train and validation shards side by side
(timm's imagenet-1k-wds) is split by their names (`tar_names.split_patterns`), whether it is DATA, --val-path or a
VAL of `evaluate`.

This module is the kind the registry (sources/__init__.py) asks: PREFIX, claims, open_split (the index or a walk),
and is_pattern and split_folder, from tar_names.py. The rest, each importing only those above it:
    tar_names.py   where a split's shards are: folder, brace or glob pattern, train and val side by side
    tar_index.py   TarShards (the index as a Source, reading samples through mmaps) and its .npz on disk
    tar_walk.py    the tar headers walked into a TarShards; labels and class names
    tar_check.py   an index held against its shards at start: kept, refused or rebuilt
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from imagenet_elastic.data.sources import index_file
from imagenet_elastic.data.sources.base import whose
from imagenet_elastic.data.sources.tar_check import check_shards
from imagenet_elastic.data.sources.tar_index import INDEX_NAME, TarShards, cache_path, pack_again, read_index
from imagenet_elastic.data.sources.tar_names import is_pattern, shard_paths, split_location, split_patterns
from imagenet_elastic.data.sources.tar_walk import LABEL_EXTENSION, walk
from imagenet_elastic.errors import UserError

PREFIX = "wds"  # `wds:PATTERN` names shards whatever the file system says (sources.kind_of)


def claims(location: str, labels_file: Optional[str] = None) -> bool:
    if is_pattern(location):
        return True
    try:
        return os.path.isdir(location) and any(name.endswith(".tar") for name in os.listdir(location))
    except OSError:
        return False


split_folder = split_patterns  # the name the registry asks every kind by (sources.both_splits)


def open_split(location: str, role: str, cache_dir: Optional[str], classes: Optional[tuple[str, ...]] = None,
               labels_file: Optional[str] = None) -> TarShards:
    """The shards at `location`: pack's index beside them, else a cached index, else a walk of their headers."""
    if labels_file is not None:
        raise UserError(f"--val-labels is for a flat folder of images, but {location} holds tar shards (their "
                        f".{LABEL_EXTENSION} members are the labels)")
    location = split_location(location, role)
    paths = shard_paths(location, role)
    beside = os.path.join(os.path.dirname(paths[0]), INDEX_NAME)
    kept = cache_path(cache_dir, role) if cache_dir else None  # where a walk's index is kept (`keep`)
    index = beside if os.path.isfile(beside) else kept
    try:
        source = read_index(index, location, role, paths, packed=index == beside) if index else None
    except index_file.Unreadable as error:
        if index == beside:
            raise UserError(f"shard index {error}: {pack_again(beside)}") from None
        return replace(walk(location, role, classes), index=kept,
                       notes=(f"the shard index cache {error}: the shards were indexed again",))
    if source is None:
        return replace(walk(location, role, classes), index=kept)
    source = check_shards(source, index, classes)
    numbered = source.classes == tuple(map(str, range(len(source.classes))))
    if classes is not None and source.classes != classes and numbered:
        source = _with_classes(source, classes)
    return source


def _with_classes(source: TarShards, classes: tuple[str, ...]) -> TarShards:
    """A split that numbers its labels takes the training split's names for them."""
    if int(source.labels.max()) >= len(classes):
        raise UserError(f"{source.role} data {source.location}: label {int(source.labels.max())} is out of range: "
                        f"{whose(classes)} has {len(classes)} classes")
    return replace(source, classes=classes)
