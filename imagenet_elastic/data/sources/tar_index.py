"""The index of a split's shards: `TarShards`, the Source whose arrays say for each sample its shard, the offset
and length of its image bytes, its label and a checksum of those bytes, and which reads a sample by them out of
this process's mmap of its shard; and the same index as one .npz (pack's beside its shards, or a cache in the
checkpoints folder), written and read back. One module, because the Source keeps itself (`keep` writes the cache)
and the file reads back into it.

The checksum (zlib's CRC-32: in the standard library, and cheap beside a decode, docs/BENCHMARKS.md) is of each
image's bytes as they were packed or first indexed, and every read compares it: a byte changed since (in place, at
the same size, even under the same mtime: rot, a faulty copy) stops the run at that sample, named, before it reaches
a batch. Sizes, mtimes and tar headers (tar_check.py) cannot see such a byte. An index from before checksums were
kept has none and is read as it is, unverified.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from imagenet_elastic.atomic_files import atomic_write_bytes
from imagenet_elastic.data.sources import index_file
from imagenet_elastic.data.sources.base import FileList, Source, digest_of
from imagenet_elastic.errors import CorruptImageError, UserError, counted

INDEX_NAME = "imagenet-elastic-index.npz"  # what `pack` writes beside its shards, last
INDEX_VERSION = 1
INDEX_ARRAYS = ("shards", "sizes", "mtimes", "classes", "labels", "shard", "offsets", "lengths")
OPTIONAL_ARRAYS = ("checksums",)  # added to version 1 later: its first files read without them
PACK_FILE = "pack.json"  # what `pack` writes at the root of a pack: its source and options (pack_again)


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
