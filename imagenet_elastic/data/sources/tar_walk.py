"""Walking the tar headers of shards into their index (a `TarShards`): each sample's `KEY.jpg` (or another
image) and `KEY.cls` found in order, its label read, its class names from a `classes.txt` or an `_info.json`. Every
wrong sample is one UserError naming its shard. `pack` walks each shard as it writes it; a start walks shards that
have no index, or whose index no longer holds (tar_check.py). A walk that indexes (pack's, a first start's) also
reads each image's bytes for its checksum (tar_index.py); one that only compares headers with an index does not.
"""

from __future__ import annotations

import json
import os
import tarfile
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from imagenet_elastic.data.sources.base import whose
from imagenet_elastic.data.sources.tar_index import TarShards
from imagenet_elastic.data.sources.tar_names import is_pattern, shard_paths
from imagenet_elastic.errors import UserError

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # in the order a sample's image is preferred
LABEL_EXTENSION = "cls"
CLASSES_FILE = "classes.txt"


def split_name(member: str) -> tuple[str, str]:
    """WebDataset's key and extension: the name up to the first dot of its last part, and the rest."""
    folder, _, base = member.rpartition("/")
    stem, dot, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension.lower() if dot else ""


@dataclass
class Found:
    """What one shard's walk found, sample by sample."""

    offsets: list[int]
    lengths: list[int]
    labels: list[int]
    checksums: Optional[list[int]] = None  # CRC-32 of each image's bytes, where the walk read them

    def same_members(self, other: Found) -> bool:
        """The same samples by their tar headers and labels (what a walk without checksums can tell)."""
        return (self.offsets, self.lengths, self.labels) == (other.offsets, other.lengths, other.labels)


def walk_shard(path: str, role: str, checksums: bool = False) -> Found:
    """Every sample of one shard, in order; a UserError naming the shard and the sample for anything wrong.
    `checksums`: also read each image's bytes for its CRC-32 (the whole shard read, where headers are a few blocks)."""
    found = Found([], [], [], [] if checksums else None)
    size = os.stat(path).st_size
    key: Optional[str] = None
    image: Optional[tarfile.TarInfo] = None
    label: Optional[int] = None

    def finish() -> None:
        if key is None or (image is None and label is None):  # not a sample (another file kept in the shard)
            return
        if image is None:
            kinds = ", ".join("." + e for e in IMAGE_EXTENSIONS)
            raise UserError(f"{role} shard {path}: sample {key} has no image ({kinds})")
        if label is None:
            raise UserError(f"{role} shard {path}: sample {key} has no label (.{LABEL_EXTENSION})")
        if image.offset_data + image.size > size:
            raise UserError(f"{role} shard {path} is truncated: sample {key} ({image.name}) ends at byte "
                            f"{image.offset_data + image.size}, the file has {size} bytes")
        found.offsets.append(image.offset_data)
        found.lengths.append(image.size)
        found.labels.append(label)
        if found.checksums is not None:
            found.checksums.append(zlib.crc32(os.pread(tar.fileobj.fileno(), image.size, image.offset_data)))

    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                member_key, extension = split_name(member.name)
                if member_key != key:
                    finish()
                    key, image, label = member_key, None, None
                if extension in IMAGE_EXTENSIONS and (image is None or preferred(extension, image.name)):
                    image = member
                elif extension == LABEL_EXTENSION:
                    label = _read_label(tar, member, path, key, role)
            finish()
    except tarfile.TarError as error:
        after = f" after sample {key}" if key else ""
        raise UserError(f"{role} shard {path} is truncated or not a tar file{after}: {error}") from None
    except OSError as error:
        raise UserError(f"cannot read {role} shard {path}: {error.strerror or error}") from None
    if not found.labels:
        raise UserError(f"{role} shard {path} holds no samples (KEY.jpg with KEY.cls)")
    return found


def preferred(extension: str, than: str) -> bool:
    """An image of this extension is preferred to the member `than` of the same sample (IMAGE_EXTENSIONS' order),
    wherever the two lie in the shard."""
    return IMAGE_EXTENSIONS.index(extension) < IMAGE_EXTENSIONS.index(split_name(than)[1])


def _read_label(tar: tarfile.TarFile, member: tarfile.TarInfo, path: str, key: Optional[str], role: str) -> int:
    stream = tar.extractfile(member)
    text = stream.read(64).decode("utf-8", "replace").strip() if stream is not None else ""
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{role} shard {path}: the label of sample {key} ({member.name}) is {text[:20]!r}, not an "
                        "integer") from None


INFO_FILE = "_info.json"  # timm's shard sets describe themselves in one
INFO_NAME_KEYS = ("class_names", "classes", "label_names")


def class_names(location: str, shards: list[str]) -> Optional[tuple[str, ...]]:
    """classes.txt in the shards' folder or the one above it, else a list of class names in an _info.json there
    (under one of INFO_NAME_KEYS), if there is one."""
    folder = os.path.dirname(shards[0]) if is_pattern(location) else location
    for where in (folder, os.path.dirname(folder)):
        candidate = os.path.join(where, CLASSES_FILE)
        if os.path.isfile(candidate):
            with open(candidate) as f:
                names = tuple(line.strip() for line in f if line.strip())
            if not names:
                raise UserError(f"classes file {candidate} is empty")
            return names
        info = os.path.join(where, INFO_FILE)
        if os.path.isfile(info):
            try:
                with open(info) as f:
                    described = json.load(f)
            except (OSError, ValueError) as error:
                raise UserError(f"{info} is not readable JSON: {error}") from None
            listed = next((described[k] for k in INFO_NAME_KEYS if isinstance(described, dict) and k in described),
                          None)
            if isinstance(listed, list) and listed:
                return tuple(str(name) for name in listed)
    return None

def walk(location: str, role: str, classes: Optional[tuple[str, ...]] = None) -> TarShards:
    """Index the shards of `location` by walking their headers, each image's checksum taken."""
    paths = shard_paths(location, role)
    return assemble(location, role, paths, [walk_shard(p, role, checksums=True) for p in paths], classes)


def assemble(location: str, role: str, paths: list[str], per_shard: list[Found],
             classes: Optional[tuple[str, ...]] = None) -> TarShards:
    """The index of shards whose walks are done (`pack` walks each shard as it writes it); with checksums where every
    walk took them."""
    named = class_names(location, paths)
    stats = [os.stat(p) for p in paths]
    labels = np.concatenate([np.array(f.labels, dtype=np.int64) for f in per_shard])
    known = named or classes or tuple(str(c) for c in range(int(labels.max()) + 1))
    check_labels(labels, known, per_shard, paths, role,
                 "the classes file lists" if named else f"{whose(classes)} has" if classes else "")
    return TarShards(location, role, tuple(paths), np.array([s.st_size for s in stats], dtype=np.int64),
                     np.array([s.st_mtime_ns for s in stats], dtype=np.int64), tuple(known), labels,
                     np.concatenate([np.full(len(f.labels), k, dtype=np.int32) for k, f in enumerate(per_shard)]),
                     np.concatenate([np.array(f.offsets, dtype=np.int64) for f in per_shard]),
                     np.concatenate([np.array(f.lengths, dtype=np.int64) for f in per_shard]),
                     checksums=None if any(f.checksums is None for f in per_shard) else
                     np.concatenate([np.array(f.checksums, dtype=np.uint32) for f in per_shard]))


def check_labels(labels: np.ndarray, classes: tuple[str, ...], per_shard: list[Found], paths: list[str], role: str,
                 named_by: str) -> None:
    """Every label is one of `classes`, which `named_by` says whose they are ("the classes file lists"), or "" where
    the labels themselves numbered them."""
    bad = np.flatnonzero((labels < 0) | (labels >= len(classes)))
    if not len(bad):
        return
    i = int(bad[0])
    shard = int(np.searchsorted(np.cumsum([len(f.labels) for f in per_shard]), i, side="right"))
    bound = f": {named_by} {len(classes)} classes" if named_by else ""
    raise UserError(f"{role} shard {paths[shard]}: label {int(labels[i])} of sample #{i} is out of range{bound}")
