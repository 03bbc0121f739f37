"""The list of images of a split: scanned once, cached next to the checkpoints, held in numpy arrays.

Listing 1.28 M files costs minutes on a network file system, on every restart. The scan therefore
records every folder it walked with its modification time, and the index is saved with them. A
later start re-reads the index when every one of those folders still has its recorded mtime (a
file added, removed or renamed changes its folder's mtime): about a thousand `stat` calls for
ImageNet instead of a full listing. The cache sits in the checkpoints folder, which the nodes of a job
share, while each node may read its own copy of the data at the same path; a copy made with `rsync -a`
or `cp -a` keeps the folders' mtimes even where it lacks a file. So the cache also holds the root
folder's inode number, which a shared file system shows every node alike and another copy does not
have: a node with its own copy scans it, and the start-up check compares what it found.

The index is three numpy arrays (fixed-width paths, targets, classes), not Python lists: DataLoader
workers forked from the main process read it without touching Python reference counts, so the
pages stay shared instead of being copied into every worker.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from imagenet_elastic.atomic_files import atomic_write_bytes
from imagenet_elastic.errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CACHE_VERSION = 2  # 2: the root folder's inode number


@dataclass(frozen=True)
class ImageIndex:
    """All images of one split."""

    root: str
    classes: tuple[str, ...]
    paths: np.ndarray  # fixed-width bytes, relative to root
    targets: np.ndarray  # int64 class index per image
    folders: np.ndarray  # every folder the scan walked (bytes, relative to root; b"." is root)
    mtimes: np.ndarray  # their st_mtime_ns at scan time
    cached: bool = False  # read from the cache rather than scanned

    def __len__(self) -> int:
        return len(self.targets)

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.paths[i].decode())


def scan_image_folder(root: str, role: str) -> ImageIndex:
    """Index ROOT/CLASS/**/IMAGE; `role` ("train", "val") names the folder in errors."""
    if not os.path.isdir(root):
        raise UserError(f"{role} folder {root} does not exist")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise UserError(f"{role} folder {root} has no class folders (expected {root}/CLASS/IMAGE.jpg)")
    paths: list[str] = []
    targets: list[int] = []
    folders = {".": os.stat(root).st_mtime_ns}
    for target, name in enumerate(classes):
        found: list[str] = []
        _walk(root, name, folders, found)
        if not found:
            raise UserError(f"class folder {os.path.join(root, name)} has no images")
        paths.extend(sorted(found))
        targets.extend([target] * len(found))
    return ImageIndex(root, tuple(classes), np.array([p.encode() for p in paths]), np.array(targets, dtype=np.int64),
                      np.array([f.encode() for f in folders]), np.array(list(folders.values()), dtype=np.int64))


def _walk(root: str, relative: str, folders: dict[str, int], found: list[str]) -> None:
    """Images under ROOT/relative (symlinks followed); each folder's mtime is taken *before* it is
    listed, so a file added during the scan makes the cache look stale next time, never current."""
    path = os.path.join(root, relative)
    folders[relative] = os.stat(path).st_mtime_ns
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir():
                _walk(root, os.path.join(relative, entry.name), folders, found)
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                found.append(os.path.join(relative, entry.name))


def cache_path(cache_dir: str, role: str) -> str:
    return os.path.join(cache_dir, f"index-{role}.npz")


def load_index(root: str, role: str, cache_dir: Optional[str]) -> ImageIndex:
    """The cached index of `root` when it is still current, else a fresh scan."""
    cached = read_cache(cache_path(cache_dir, role), root) if cache_dir else None
    return cached if cached is not None else scan_image_folder(root, role)


def write_cache(index: ImageIndex, path: str) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, version=np.int64(CACHE_VERSION), root=np.array(os.path.abspath(index.root)),
             root_inode=np.int64(os.stat(index.root).st_ino), classes=np.array(index.classes), paths=index.paths,
             targets=index.targets, folders=index.folders, mtimes=index.mtimes)
    atomic_write_bytes(buffer.getvalue(), path)


def read_cache(path: str, root: str) -> Optional[ImageIndex]:
    """None when there is no cache, it is of another root, copy or version, unreadable, or any folder changed."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            if (int(saved["version"]) != CACHE_VERSION or str(saved["root"]) != os.path.abspath(root)
                    or int(saved["root_inode"]) != os.stat(root).st_ino):
                return None
            folders, mtimes = saved["folders"], saved["mtimes"]
            for folder, mtime in zip(folders, mtimes):
                if os.stat(os.path.join(root, folder.decode())).st_mtime_ns != mtime:
                    return None
            return ImageIndex(root, tuple(str(c) for c in saved["classes"]), saved["paths"], saved["targets"],
                              folders, mtimes, cached=True)
    except (OSError, ValueError, KeyError):  # missing or damaged file, a folder gone: scan again
        return None


def train_dir(data: str) -> str:
    """DATA/train, or DATA itself when it has no train/."""
    if not os.path.isdir(data):
        raise UserError(f"data folder {data} does not exist")
    train = os.path.join(data, "train")
    return train if os.path.isdir(train) else data


def resolve_split_dirs(data: str, val_path: Optional[str]) -> tuple[str, str]:
    """DATA/train and DATA/val; DATA itself is the train folder when it has no train/."""
    train = train_dir(data)
    val = val_path or os.path.join(data, "val")
    if not os.path.isdir(val):
        raise UserError(f"validation folder {val} does not exist" +
                        ("" if val_path else "; pass --val-path"))
    return train, val


def check_same_classes(train: ImageIndex, val: ImageIndex) -> None:
    if train.classes == val.classes:
        return
    only_train = sorted(set(train.classes) - set(val.classes))[:5]
    only_val = sorted(set(val.classes) - set(train.classes))[:5]
    raise UserError(
        f"train ({train.root}) and val ({val.root}) class folders differ: "
        f"{len(train.classes)} vs {len(val.classes)} classes; only in train: {only_train}, only in val: {only_val}"
    )
