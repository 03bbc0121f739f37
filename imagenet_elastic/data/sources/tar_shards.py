"""WebDataset tar shards as a source: each sample is consecutive members `KEY.jpg` (or .jpeg, .png, .webp) and
`KEY.cls` (the label as a decimal integer), where KEY is the member's name up to the first dot of its last part, as
WebDataset and timm's imagenet-1k-wds shards have them.

A split is a folder of `*.tar` files (sorted by name), or a brace or glob pattern
(`/data/imagenet-train-{000000..001023}.tar`). A folder that holds train and validation shards side by side (timm's
imagenet-1k-wds) is split by their names (`split_patterns`), whether it is DATA, --val-path or a VAL of `evaluate`.
Class names come from a `classes.txt` (one per line, in label order) in the shards' folder or the one above it, or a
`class_names` list in an `_info.json` there; without either the labels are the names ("0", "1", ...), or the
training split's classes for a val split.

The first start walks every shard's tar headers once and keeps an index (`TarShards`): for each sample its shard,
the offset and length of its image bytes, its label and a CRC-32 of its image bytes, in numpy arrays (32 bytes a
sample: 39 MB for ImageNet's 1.28 M images, shared by forked loader workers; docs/BENCHMARKS.md). `imagenet-elastic
pack` writes that index beside its shards (INDEX_NAME, written last); shards from elsewhere are indexed at the first
start and the index is kept in the checkpoints folder. Either is checked against its shards at every start
(`check_shards`): a pack's shard changed since is refused, one from elsewhere is indexed again, said.

The checksum (zlib's CRC-32: in the standard library, and cheap beside a decode, docs/BENCHMARKS.md) is of each
image's bytes as they were packed or first indexed, and every read compares it: a byte changed since (in place, at
the same size, even under the same mtime: rot, a faulty copy) stops the run at that sample, named, before it reaches
a batch. Sizes, mtimes and tar headers cannot see such a byte. An index from before checksums were kept has none and
is read as it is, unverified.

Reading sample i maps its shard (once per process, lazily: a loader worker maps what it reads) and copies the
sample's bytes out of the mapping: no open, no seek, no directory lookup per sample, and any sample at any moment,
so the world-size-invariant sampler, step-exact resume and --ra-reps work as with a folder of files.
"""

from __future__ import annotations

import glob
import io
import json
import mmap
import os
import re
import tarfile
import time
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from imagenet_elastic.atomic_files import atomic_write_bytes
from imagenet_elastic.data.sources import index_file
from imagenet_elastic.data.sources.base import FileList, Source, digest_of, whose
from imagenet_elastic.errors import CorruptImageError, UserError, counted

PREFIX = "wds"  # `wds:PATTERN` names shards whatever the file system says (sources.kind_of)
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # in the order a sample's image is preferred
LABEL_EXTENSION = "cls"
CLASSES_FILE = "classes.txt"
INFO_FILE = "_info.json"  # timm's shard sets describe themselves in one
INFO_NAME_KEYS = ("class_names", "classes", "label_names")
INDEX_NAME = "imagenet-elastic-index.npz"  # what `pack` writes beside its shards, last
INDEX_VERSION = 1
INDEX_ARRAYS = ("shards", "sizes", "mtimes", "classes", "labels", "shard", "offsets", "lengths")
OPTIONAL_ARRAYS = ("checksums",)  # added to version 1 later: its first files read without them
PACK_FILE = "pack.json"  # what `pack` writes at the root of a pack: its source and options (pack_again)
_PATTERN_CHARS = "{*?["


# ----------------------------------------------------------------------------- where a split's shards are

def is_pattern(location: str) -> bool:
    """A brace or glob pattern of shards, or one shard, rather than a folder."""
    return any(c in location for c in _PATTERN_CHARS) or location.endswith(".tar")


def claims(location: str, labels_file: Optional[str] = None) -> bool:
    if is_pattern(location):
        return True
    try:
        return os.path.isdir(location) and any(name.endswith(".tar") for name in os.listdir(location))
    except OSError:
        return False


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace notation: `a-{000..003}.tar` counts with the first number's width (a-000.tar ...
    a-003.tar), `{x,y}` lists alternatives; several braces multiply."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[:match.start()], match.group(1), pattern[match.end():]
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if span:
        first, last = span.groups()
        items = [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    else:
        items = body.split(",")
    return [expanded for item in items for expanded in expand_braces(head + item + tail)]


def pattern_files(location: str, role: str, what: str) -> list[str]:
    """The files of a brace or glob pattern, in order (each brace part globbed); one that is not there is a
    UserError naming it as the split's `what` ("shard", "parquet file")."""
    paths = []
    for part in expand_braces(location):
        found = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
        missing = next((p for p in found if not os.path.isfile(p)), None) if found else part
        if missing is not None:
            raise UserError(f"{role} {what} {missing} does not exist (from {location})")
        paths.extend(found)
    return paths


def shard_paths(location: str, role: str) -> list[str]:
    """The shards of a split, in order: a folder's `*.tar` by name, or a pattern's expansion (each part globbed)."""
    if not is_pattern(location):
        paths = sorted(os.path.join(location, name) for name in os.listdir(location) if name.endswith(".tar"))
    else:
        paths = pattern_files(location, role, "shard")
    if not paths:
        raise UserError(f"{role} data {location} holds no .tar shards")
    return paths


def split_patterns(folder: str) -> Optional[tuple[str, str]]:
    """Patterns of the train and val shards of a folder that holds both side by side, as timm's imagenet-1k-wds
    does (`imagenet1k-train-0000.tar` ... beside `imagenet1k-validation-00.tar` ...); None for a folder of one
    split's shards. A folder of both whose names do not tell every shard's split is refused."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".tar"))
    except OSError:
        return None
    train = {n for n in names if "train" in n}
    for word in ("validation", "val"):
        val = {n for n in names if re.search(rf"(^|[-_.]){word}([-_.]|$)", n)}
        if not (train and val):
            continue
        unclear = [n for n in names if (n in train) == (n in val)]
        if unclear:
            raise UserError(f"{folder} holds train shards ({min(train - val or train)} ...) and {word} shards "
                            f"({min(val - train or val)} ...), and {unclear[0]}, whose name says "
                            f"{'both' if unclear[0] in train else 'neither'}: name each split's shards with a pattern "
                            f"({os.path.join(folder, '*train*.tar')}, {os.path.join(folder, f'*{word}*.tar')})")
        return os.path.join(folder, "*train*.tar"), os.path.join(folder, f"*{word}*.tar")
    return None


split_folder = split_patterns  # the name the registry asks every kind by (sources.both_splits)


def split_location(location: str, role: str) -> str:
    """`location` itself, or this split's shards where it is a folder of train and validation shards side by side:
    a folder given as --val-path, or to `evaluate`, scores its validation shards alone."""
    both = None if is_pattern(location) else split_patterns(location)
    return location if both is None else both[0] if role == "train" else both[1]


# ----------------------------------------------------------------------------- the index as a Source

@dataclass(frozen=True)
class TarShards(Source):
    location: str  # as given: a folder or a pattern
    role: str
    shards: tuple[str, ...]  # paths, in order
    sizes: np.ndarray  # int64 bytes of each shard when indexed
    mtimes: np.ndarray  # int64 st_mtime_ns of each shard when indexed
    classes: tuple[str, ...]
    labels: np.ndarray  # int64 per sample
    shard: np.ndarray  # int32 per sample: which shard
    offsets: np.ndarray  # int64 per sample: where its image's bytes begin in the shard
    lengths: np.ndarray  # int64 per sample: how many
    cached: bool = False  # the index was read, not walked
    packed: bool = False  # the index is the one `pack` wrote beside the shards
    notes: tuple[str, ...] = ()  # what opening it found worth a warning (Source.notes)
    checksums: Optional[np.ndarray] = None  # uint32 per sample: CRC-32 of its image's bytes; None: an older index
    index: Optional[str] = None  # the index file it was read from or is kept in, for messages

    def read(self, i: int) -> bytes:
        path = self.shards[int(self.shard[i])]
        start, length = int(self.offsets[i]), int(self.lengths[i])
        try:
            mapped, fd = _mapped(path)
            size = os.fstat(fd).st_size  # a shard cut short while mapped would raise SIGBUS, not an error
        except OSError as error:
            raise CorruptImageError(f"cannot read shard {path}: {error.strerror or error}") from None
        if start + length > size:
            raise CorruptImageError(f"shard {path} is truncated: sample #{i} ends at byte {start + length}, the "
                                    f"file has {size} bytes")
        if _header_size(mapped, start) != length:
            raise CorruptImageError(f"shard {path} does not match its index at sample #{i} (byte {start}): was the "
                                    "shard replaced after it was indexed?")
        data = mapped[start:start + length]
        if self.checksums is not None and zlib.crc32(data) != int(self.checksums[i]):
            raise CorruptImageError(self.changed_bytes(i))
        return data

    def changed_bytes(self, i: int) -> str:
        """The line for sample i, whose bytes are not those its checksum was taken of, and what to do about it."""
        path, index = self.shards[int(self.shard[i])], self.index or "its index"
        if self.packed:
            return (f"shard {path} member {self.member(i)} has other bytes than when it was packed (its checksum in "
                    f"{index} differs): the shard changed after it was packed; {pack_again(index)}")
        again = f"remove {self.index} to index the shards again" if self.index else "start again to index them again"
        return (f"shard {path} member {self.member(i)} has other bytes than when it was indexed (its checksum in "
                f"{index} differs): the shard changed since; restore it, or {again}")

    def name(self, i: int) -> str:
        return f"{self.shards[int(self.shard[i])]}:{self.member(i)}"

    def member(self, i: int) -> str:
        """Sample i's image member's name, from the ustar header before its bytes: its name and prefix fields
        alone (a loader asks it for every sample it reads, for its errors; parsing the whole header cost ~4% of
        a worker's time)."""
        path, offset = self.shards[int(self.shard[i])], int(self.offsets[i])
        try:
            mapped, _ = _mapped(path)
        except OSError:
            return f"sample #{i} at byte {offset}"
        header = mapped[offset - 512:offset]
        name = header[:100].split(b"\0", 1)[0]
        if header[257:262] == b"ustar" and header[345] != 0:
            name = header[345:500].split(b"\0", 1)[0] + b"/" + name
        return name.decode("utf-8", "surrogateescape")

    def where(self) -> str:
        return f"{self.location} ({counted(len(self.shards), 'shard')})"

    def entries(self) -> np.ndarray:
        """`SHARD.tar:MEMBER` of each sample: the headers are read only when two nodes' fingerprints differ."""
        names = [os.path.basename(p) for p in self.shards]
        return np.array([f"{names[int(self.shard[i])]}:{self.member(i)}".encode() for i in range(len(self))])

    def sample_columns(self) -> tuple[np.ndarray, ...]:
        """Each sample's shard (by name), where its image lies in it and how long it is, and its label."""
        names = np.array([os.path.basename(p).encode() for p in self.shards])
        return names[self.shard], self.offsets, self.lengths, self.labels

    def fingerprint(self) -> FileList:
        """The index's own arrays: no entry strings are built at every start."""
        names = np.array([os.path.basename(p).encode() for p in self.shards])
        return FileList(len(self), len(self.classes), digest_of(self.classes, names, self.sizes, self.shard,
                                                                self.offsets, self.lengths, self.labels))

    def describe(self) -> str:
        how = "index written by pack" if self.packed else "index from the cache" if self.cached else ""
        unverified = ", no checksums" if how and self.checksums is None else ""
        return f"{len(self)} in {self.where()}" + (f" ({how}{unverified})" if how else "")

    def keep(self, cache_dir: str) -> None:
        if not self.cached and not self.packed:
            write_index(self, cache_path(cache_dir, self.role), relative_to=None)


_MAPS: dict[str, tuple[mmap.mmap, int]] = {}
_MAPS_PID = [0]


def _mapped(path: str) -> tuple[mmap.mmap, int]:
    """This process's read-only mapping of a shard and its descriptor, made on first use. A forked worker makes
    its own (the parent's, inherited, stay as they are)."""
    if _MAPS_PID[0] != os.getpid():
        _MAPS.clear()
        _MAPS_PID[0] = os.getpid()
    found = _MAPS.get(path)
    if found is None:
        fd = os.open(path, os.O_RDONLY)
        try:
            found = mmap.mmap(fd, 0, access=mmap.ACCESS_READ), fd
        except BaseException:
            os.close(fd)
            raise
        _MAPS[path] = found
    return found


def _header_size(mapped: mmap.mmap, data_offset: int) -> Optional[int]:
    """The size field of the tar header right before a member's data (None if it cannot be read)."""
    field = mapped[data_offset - 512 + 124:data_offset - 512 + 136]
    try:
        return int(field.rstrip(b"\0 ").strip() or b"0", 8)
    except ValueError:  # base-256 sizes (members of 8 GB and more) or not a header
        return None


# ----------------------------------------------------------------------------- the index on disk

def cache_path(cache_dir: str, role: str) -> str:
    return os.path.join(cache_dir, f"index-{role}-shards.npz")


def write_index(source: TarShards, path: str, relative_to: Optional[str]) -> None:
    """The index as one .npz, written atomically; `relative_to`: shard paths saved relative to this folder
    (pack's index beside its shards), else absolute (a cache)."""
    names = [os.path.relpath(p, relative_to) if relative_to else os.path.abspath(p) for p in source.shards]
    buffer = io.BytesIO()
    np.savez(buffer, version=np.int64(INDEX_VERSION), location=np.array(os.path.abspath(source.location)),
             shards=np.array(names), sizes=source.sizes, mtimes=source.mtimes, classes=np.array(source.classes),
             labels=source.labels, shard=source.shard, offsets=source.offsets, lengths=source.lengths,
             **({} if source.checksums is None else {"checksums": source.checksums}))
    atomic_write_bytes(buffer.getvalue(), path)


def read_index(path: str, location: str, role: str, shards: list[str], packed: bool) -> Optional[TarShards]:
    """The index at `path` if it is of these shards. A cache (not `packed`) of other or changed shards is None:
    they are walked again. Pack's own index that no longer matches its shards is an error naming the shard. A
    damaged file is index_file.Unreadable."""
    saved = index_file.read(path, INDEX_VERSION, INDEX_ARRAYS, OPTIONAL_ARRAYS)
    if saved is None:
        return None
    folder = os.path.dirname(path)
    listed = [os.path.normpath(os.path.join(folder, str(s))) for s in saved["shards"]]
    sizes, mtimes = saved["sizes"], saved["mtimes"]
    arrays = {k: saved[k] for k in ("labels", "shard", "offsets", "lengths")}
    classes = tuple(str(c) for c in saved["classes"])
    current = [os.path.normpath(os.path.abspath(p)) for p in shards]
    if [os.path.abspath(p) for p in listed] != current:
        if packed:
            missing = sorted(set(map(os.path.abspath, listed)) ^ set(current))[:1]
            raise UserError(f"shard index {path} lists other shards than {location} holds ({missing[0]}): was the "
                            "pack changed after it was written?")
        return None
    return TarShards(location, role, tuple(shards), sizes, mtimes, classes, arrays["labels"], arrays["shard"],
                     arrays["offsets"], arrays["lengths"], cached=True, packed=packed, checksums=saved.get("checksums"),
                     index=path)


def pack_again(index: str) -> str:
    """How to get a pack whose index holds: its command again (from pack.json, where it is), or a walk at start."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(index)))
    command = "imagenet-elastic pack SRC NEW_OUT"
    try:
        with open(os.path.join(root, PACK_FILE)) as f:
            record = json.load(f)
        options = record["options"]
        flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in options.items()
                        if v is not None and (k != "quality" or options.get("max_side") is not None))
        command = f"imagenet-elastic pack {record['source']} NEW_OUT{flags}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return f"pack again ({command}), or remove {index} to index the shards at start"


# ----------------------------------------------------------------------------- walking the tar headers

# `pack` walks each shard as it writes it; a start walks shards that have no index, or whose index no longer
# holds. A walk that indexes (pack's, a first start's) also reads each image's bytes for its checksum; one that only
# compares headers with an index does not.

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


# ----------------------------------------------------------------------------- an index held against its shards

def check_shards(source: TarShards, index: str, classes: Optional[tuple[str, ...]] = None) -> TarShards:
    """The index `source` (read from `index`) if its shards are still the ones it describes.

    Each shard's size and st_mtime_ns, taken when it was indexed, against a `stat` of it now: one call a shard,
    milliseconds for 1,024 shards, where a digest of their contents would read 140 GB and one of their
    member headers 2.5 M scattered blocks at every start. Any write changes the mtime, so a shard changed in place
    at its old size is seen, and a copy that keeps mtimes (`cp -a`, `rsync -a`, `tar x`) of a changed shard carries
    the changed one's mtime, not the one recorded. What mtimes cannot tell is a faithful copy that does not keep
    them (`cp -r`, most object-store downloads): a shard whose size is the same and mtime is not is therefore
    walked again (its tar headers and labels, ~40 ms for 1,250 samples) and compared with the index. Equal headers
    are a copy, or bytes changed in place at the same size: reading every byte to tell which would cost a copied
    pack 140 GB at every start, so the samples' checksums (TarShards.read) tell it as each is read instead.

    A pack's index (`source.packed`) is a promise about its shards: a shard of another size, or walked to other
    samples, is refused, naming it and how to pack again; shards of other mtimes and the same headers are kept, with
    a note of what that check cost. A cache of shards from elsewhere is the trainer's own: a changed shard is walked
    again (with checksums, where the index has them) and the index rebuilt from its walk and the others' entries,
    with a note naming it."""
    stats = [os.stat(p) for p in source.shards]
    resized = [k for k, stat in enumerate(stats) if stat.st_size != int(source.sizes[k])]
    touched = [k for k, stat in enumerate(stats) if k not in resized and stat.st_mtime_ns != int(source.mtimes[k])]
    if source.packed and resized:
        k = resized[0]
        raise UserError(f"shard {source.shards[k]} has {stats[k].st_size} bytes but its index {index} says "
                        f"{int(source.sizes[k])}: the shard was replaced or cut short after it was packed; "
                        f"{pack_again(index)}")
    if not resized and not touched:
        return source
    start = time.perf_counter()
    walked = {k: walk_shard(source.shards[k], source.role) for k in (*resized, *touched)}
    seconds = time.perf_counter() - start
    changed = [k for k in sorted(walked) if not walked[k].same_members(indexed_samples(source, k))]
    if source.packed:
        if changed:
            k = changed[0]
            raise UserError(f"shard {source.shards[k]} differs from its index {index} "
                            f"({first_difference(indexed_samples(source, k), walked[k])}): it was changed after it "
                            f"was packed; {pack_again(index)}")
        return replace(source, notes=(touched_note(source, len(touched), seconds),))
    if not changed:  # touched alone: the index holds, with the shards' mtimes of now
        return replace(source, sizes=np.array([stat.st_size for stat in stats], dtype=np.int64),
                       mtimes=np.array([stat.st_mtime_ns for stat in stats], dtype=np.int64), cached=False)
    k = changed[0]
    others = f" (and {len(changed) - 1} other shards)" if len(changed) > 1 else ""
    if source.checksums is not None:  # the rebuilt index keeps them: the changed shards' bytes are read for theirs
        walked = {j: walk_shard(source.shards[j], source.role, checksums=True) for j in changed}
    found = [walked[j] if j in changed else indexed_samples(source, j) for j in range(len(source.shards))]
    rebuilt = assemble(source.location, source.role, list(source.shards), found, classes)
    return replace(rebuilt, index=source.index,
                   notes=(f"shard {source.shards[k]}{others} changed since it was indexed: indexed again",))


def touched_note(source: TarShards, touched: int, seconds: float) -> str:
    """What a pack's shards of other mtimes and the same headers are, and what will tell."""
    tells = ("; each sample's checksum, compared as it is read, stops the run at a changed one"
             if source.checksums is not None else
             ", which this index cannot tell apart (it has no checksums: pack again to have them)")
    return (f"{touched} shards of {source.location} have other mtimes than its index records and the same members: a "
            f"copy that did not keep mtimes (`cp -a` or `rsync -a` keep them), or bytes changed in place{tells}; "
            f"checking their headers took {seconds:.1f} s")


def indexed_samples(source: TarShards, k: int) -> Found:
    """Shard k's samples as the index holds them."""
    lo, hi = np.searchsorted(source.shard, [k, k + 1]).tolist()
    return Found(source.offsets[lo:hi].tolist(), source.lengths[lo:hi].tolist(), source.labels[lo:hi].tolist(),
                 None if source.checksums is None else source.checksums[lo:hi].tolist())


def first_difference(indexed: Found, walked: Found) -> str:
    """What a shard's walk found that its index does not say, for the message."""
    if len(walked.labels) != len(indexed.labels):
        return f"{len(walked.labels)} samples, the index {len(indexed.labels)}"
    j = next(j for j in range(len(walked.labels)) if (walked.offsets[j], walked.lengths[j], walked.labels[j])
             != (indexed.offsets[j], indexed.lengths[j], indexed.labels[j]))
    if walked.labels[j] != indexed.labels[j]:
        return f"its sample {j} has label {walked.labels[j]}, the index {indexed.labels[j]}"
    return f"its sample {j} lies at bytes {walked.offsets[j]}+{walked.lengths[j]}, the index says " \
           f"{indexed.offsets[j]}+{indexed.lengths[j]}"


# ----------------------------------------------------------------------------- opening a split

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
