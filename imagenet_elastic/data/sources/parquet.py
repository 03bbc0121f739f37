"""Parquet files read in place (the `parquet` extra): Hugging Face's imagenet-1k (`train-*.parquet`, `validation-*`:
rows of image{bytes,path} and label, ClassLabel names in the metadata), or any files with an `image` column (that
struct, or bytes) and an integer `label`; without ClassLabel names, base.checked_classes names the classes.

A split is a `.parquet` file, a glob or brace pattern, or a folder (or its `data/`) whose files are split by a part
of their names (`train`; `validation`, `valid` or `val`; `test` is never read), else one split. A process keeps the one
row group it read last: sequential reads read each group once, a shuffled epoch one per sample, why `pack` is the form
to train from at scale (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from imagenet_elastic.data.sources.base import FileList, Source, checked_classes, digest_of, shown
from imagenet_elastic.data.sources.tar_shards import check_numbered, pattern_files
from imagenet_elastic.errors import CorruptImageError, UserError, counted

PREFIX = "parquet"
SUFFIX = ".parquet"
SUBFOLDER = "data"  # the Hub's datasets keep their files in data/
SPLIT_WORDS = {"train": ("train",), "val": ("validation", "valid", "val")}  # a part of a file's name, between - _ .


def pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading parquet files needs pyarrow: pip install 'imagenet_elastic[parquet]'") from None
    return pq


def is_pattern(location: str) -> bool:
    """One parquet file, or a pattern of them."""
    return location.endswith(SUFFIX)


def folder_files(folder: str) -> list[str]:
    """A folder's .parquet files, else its data/'s; no deeper (a class-folder tree's 1.28 M files take minutes)."""
    for where in (folder, os.path.join(folder, SUBFOLDER)):
        try:
            names = sorted(n for n in os.listdir(where) if n.endswith(SUFFIX))
        except OSError:
            continue
        if names:
            return [os.path.join(where, n) for n in names]
    return []


def split_of(path: str) -> Optional[str]:
    """"train", "val" or None, from a part of a file's name (`train-00000-of-00294.parquet`, `validation-...`,
    `imagenet-1k-validation-...`; `test-...`: None)."""
    parts = re.split(r"[-_.]", os.path.basename(path).lower())
    return next((role for role, words in SPLIT_WORDS.items() if any(word in parts for word in words)), None)


def claims(location: str, labels_file: Optional[str] = None) -> bool:
    return is_pattern(location) or (os.path.isdir(location) and bool(folder_files(location)))


def split_folder(folder: str) -> Optional[tuple[str, str]]:
    """The folder as both splits when its files are named by split (each takes its own files, `role_files`)."""
    return (folder, folder) if any(split_of(p) for p in folder_files(folder)) else None


def role_files(location: str, role: str) -> list[str]:
    """The files of a split, in order: a pattern's, or the folder's named for the role (all when none is named)."""
    if not os.path.isdir(location):
        return pattern_files(location, role, "parquet file")
    files = folder_files(location)
    if not files:
        raise UserError(f"{role} data {location} holds no .parquet files")
    named = [p for p in files if split_of(p) == role]
    if not named and any(split_of(p) for p in files):
        words = " or ".join(f"{w}-*{SUFFIX}" for w in SPLIT_WORDS[role])
        raise UserError(f"{location} holds no {role} parquet files (named {words})")
    check_numbered(named or files, role)
    return named or files


@dataclass(frozen=True)
class ParquetFiles(Source):
    location: str  # as given: a folder, a file or a pattern
    role: str
    files: tuple[str, ...]  # paths, in order
    sizes: np.ndarray  # int64 bytes of each file, for the start-up check across nodes
    classes: tuple[str, ...]
    labels: np.ndarray  # int64 per sample
    starts: np.ndarray  # int64: the first sample of each row group, and the total at the end
    group_file: np.ndarray  # int32 per row group: its file
    group_number: np.ndarray  # int32 per row group: its number in that file
    file_starts: np.ndarray  # int64: the first sample of each file
    notes: tuple[str, ...] = ()  # what opening it found worth a warning (Source.notes)

    def group(self, i: int) -> int:
        return int(np.searchsorted(self.starts, i, side="right")) - 1

    def read(self, i: int) -> bytes:
        g = self.group(i)
        raw = _row_group(self, g, images=True).images[i - int(self.starts[g])].as_py()
        if not raw:
            raise CorruptImageError(f"{self.name(i)} has no image bytes")
        return raw

    def name(self, i: int) -> str:
        """`FILE:ROW`, then the image's own path where the file keeps it (`...:ILSVRC2012_val_00000001.JPEG`)."""
        g = self.group(i)
        f = int(self.group_file[g])
        where = f"{self.files[f]}:{i - int(self.file_starts[f])}"
        paths = _row_group(self, g, images=False).paths
        path = paths[i - int(self.starts[g])].as_py() if paths is not None else None
        return f"{where}:{path}" if path else where

    def where(self) -> str:
        return f"{self.location} ({counted(len(self.files), 'parquet file')})"

    def label_of(self, i: int) -> str:
        """Sample i's label, by its file and row there, as an error names it."""
        f = int(np.searchsorted(self.file_starts, i, side="right")) - 1
        return (f"{self.role} parquet file {self.files[f]}: label {int(self.labels[i])} of row "
                f"{i - int(self.file_starts[f])}")

    def entries(self) -> np.ndarray:
        """`FILE.parquet:ROW` of each sample."""
        names = [os.path.basename(p) for p in self.files]
        counts = np.diff(np.append(self.file_starts, len(self)))
        return np.array([f"{names[f]}:{row}".encode() for f, n in enumerate(counts.tolist()) for row in range(n)])

    def sample_columns(self) -> tuple[np.ndarray, ...]:
        """Each sample's file (by name) and that file's size, and its label."""
        names = np.array([os.path.basename(p).encode() for p in self.files])
        file = np.repeat(np.arange(len(self.files)), np.diff(np.append(self.file_starts, len(self))))
        return names[file], self.sizes[file], self.labels

    def fingerprint(self) -> FileList:
        """The file names, sizes and row groups with the labels: no entry strings built at every start."""
        names = np.array([os.path.basename(p).encode() for p in self.files])
        return FileList(len(self), len(self.classes),
                        digest_of(self.classes, names, self.sizes, self.starts, self.group_file, self.labels))


@dataclass
class _Group:
    """One row group as this process read it last: its paths and (when asked) images, as pyarrow arrays, not objects."""

    paths: Any  # pyarrow StringArray, or None where the file keeps no paths
    images: Any  # pyarrow BinaryArray, or None: only the paths were read


_OPEN: dict[str, Any] = {}  # this process's ParquetFile of each file it read
_KEPT: dict[tuple[str, int], _Group] = {}  # the one row group it keeps, by (file, row group number)
os.register_at_fork(after_in_child=_OPEN.clear)  # a forked worker opens its own files and keeps its own group
os.register_at_fork(after_in_child=_KEPT.clear)


def _row_group(source: ParquetFiles, g: int, images: bool) -> _Group:
    """Row group g: this process's one kept group, or read now (the image column when `images`, else the paths)."""
    import pyarrow as pa

    path, number = source.files[int(source.group_file[g])], int(source.group_number[g])
    kept = _KEPT.get((path, number))
    if kept is not None and (kept.images is not None or not images):
        return kept
    try:
        file = _OPEN.get(path)
        if file is None:
            file = _OPEN[path] = pyarrow_parquet().ParquetFile(path)
        image = file.schema_arrow.field("image").type
        has_paths = pa.types.is_struct(image) and image.get_field_index("path") >= 0
        if not images and not has_paths:
            return _Group(None, None)
        column = file.read_row_group(number, columns=["image"] if images else ["image.path"],
                                     use_threads=False).column("image").combine_chunks()
    except (OSError, ValueError, KeyError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise CorruptImageError(f"cannot read row group {number} of parquet file {path}: {error}") from None
    encoded = (column.field("bytes") if pa.types.is_struct(image) else column) if images else None
    _KEPT.clear()
    kept = _KEPT[path, number] = _Group(column.field("path") if has_paths else None, encoded)
    return kept


# ----------------------------------------------------------------------------- opening a split

def label_names(schema: Any) -> Optional[tuple[str, ...]]:
    """The ClassLabel names the `datasets` library writes into a parquet file's metadata, if it did."""
    try:
        names = json.loads(schema.metadata[b"huggingface"])["info"]["features"]["label"]["names"]
        return tuple(str(n) for n in names) or None
    except (TypeError, KeyError, ValueError):
        return None


def check_columns(schema: Any, path: str) -> None:
    import pyarrow as pa

    missing = {"image", "label"} - set(schema.names)
    if missing:
        raise UserError(f"parquet file {path} has no column {sorted(missing)[0]!r} (imagenet-1k's rows are "
                        "image{bytes,path} and label)")
    image, label = schema.field("image").type, schema.field("label").type
    images = (pa.types.is_struct(image) and image.get_field_index("bytes") >= 0) or pa.types.is_binary(image) \
        or pa.types.is_large_binary(image)
    if not images or not pa.types.is_integer(label):
        raise UserError(f"parquet file {path}: column image is {image} and label is {label}; expected image "
                        "struct<bytes, path> (or binary) and an integer label")


def open_split(location: str, role: str, cache_dir: Optional[str], classes: Optional[tuple[str, ...]] = None,
               labels_file: Optional[str] = None) -> ParquetFiles:
    """The rows of the split's files: their footers and label columns read now (one thread: loader workers fork
    after this), the images when asked for. `classes`: the training split's, for files that name none."""
    if labels_file is not None:
        raise UserError(f"--val-labels is for a flat folder of images, but {location} holds parquet files (their "
                        "label column is the labels)")
    pq = pyarrow_parquet()
    paths = role_files(location, role)
    named: Optional[tuple[str, ...]] = None
    labels, starts, group_file, group_number, file_starts, sizes = [], [0], [], [], [], []
    for f, path in enumerate(paths):
        try:
            file = pq.ParquetFile(path)
            check_columns(file.schema_arrow, path)
            read = file.read(columns=["label"], use_threads=False).column("label")
            sizes.append(os.path.getsize(path))
        except UnicodeEncodeError:  # a ValueError: pyarrow takes a path as UTF-8 text
            raise UserError(f"{role} parquet file {shown(path)}: pyarrow opens no file whose name is not UTF-8: rename "
                            "it") from None
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
            raise UserError(f"{role} parquet file {path} is not readable: {error}") from None
        if read.null_count:
            row = int(np.flatnonzero(read.is_null().to_numpy())[0])
            raise UserError(f"{role} parquet file {path}: row {row} has no label")
        named = named or label_names(file.schema_arrow)
        file_starts.append(starts[-1])
        for g in range(file.metadata.num_row_groups):
            starts.append(starts[-1] + file.metadata.row_group(g).num_rows)
            group_file.append(f)
            group_number.append(g)
        labels.append(read.to_numpy().astype(np.int64))
    all_labels = np.concatenate(labels)  # role_files gives at least one file
    if not len(all_labels):
        raise UserError(f"{role} data {location} holds no rows")
    source = ParquetFiles(location, role, tuple(paths), np.array(sizes, dtype=np.int64), (), all_labels,
                          np.array(starts, dtype=np.int64), np.array(group_file, dtype=np.int32),
                          np.array(group_number, dtype=np.int32), np.array(file_starts, dtype=np.int64))
    source = replace(source, classes=checked_classes(all_labels, source.label_of, named, classes, "the files name",
                                                     "files without class names (ClassLabel metadata)"))
    rows = len(all_labels) / max(1, len(group_file))
    if role == "train" and rows > 1:
        return replace(source, notes=(
            f"training from parquet files in place reads a row group ({rows:.0f} images on average here) for each "
            "shuffled sample: `imagenet-elastic pack` makes tar shards that train several times faster",))
    return source
