"""WebDataset tar shards as a source: a sample is consecutive members `KEY.jpg` (or .jpeg, .png, .webp) and `KEY.cls`
(its label, a decimal integer), KEY the member's name up to the first dot of its last part (as in WebDataset: the
extension of `KEY.x.jpg` is `x.jpg`, an image by its last part where the sample has no `.jpg`). A split is a folder of
`*.tar` (by name) or a brace or glob pattern. Class names come from a `classes.txt` (a name a line, in label order) or
an `_info.json` beside the shards or one folder up; else the labels are the names, or a val split takes train's.

The index (`TarShards`: numpy arrays, shared by forked loader workers) is written by `pack` beside its shards, else
kept in the checkpoints folder at the first start. Every read compares the sample's CRC-32 (cheap beside a decode): a
byte changed in place at the same size and mtime, which sizes, mtimes and headers cannot see, stops the run there,
named. A shard is mapped once per process: no open or seek per sample, and random access for the sampler and resume.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import glob
import itertools
import json
import mmap
import operator
import os
import posixpath
import re
import shlex
import tarfile
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from imagenet_elastic.data.sources import index_file, object_store
from imagenet_elastic.data.sources.base import FileList, Source, check_range, checked_classes, digest_of, shown, whose
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
OPTIONAL_ARRAYS = ("checksums", "etags")  # added to version 1 later: its first files read without them
GZIPPED = (".tar.gz", ".tgz")  # shards a folder may hold compressed: refused, named (gzip_line)
GZIP_MAGIC = b"\x1f\x8b"
PACK_FILE = "pack.json"  # what `pack` writes at the root of a pack: its source and options (pack_again)


# ----------------------------------------------------------------------------- where a split's shards are

def is_pattern(location: str) -> bool:
    """A brace or glob pattern of shards, or one shard, rather than a folder."""
    return any(c in location for c in "{*?[") or location.endswith((".tar", *GZIPPED))


def claims(location: str, labels_file: Optional[str] = None) -> bool:
    if is_pattern(location) or object_store.is_url(location):  # the one kind a store holds
        return True
    with contextlib.suppress(OSError, ValueError):  # not a folder, none to read, or a NUL in the name
        return any(name.endswith((".tar", *GZIPPED)) for name in os.listdir(location))  # .tar.gz: to be named
    return False


def expand_braces(pattern: str) -> list[str]:
    """WebDataset braces: `a-{000..003}.tar` counts at the first number's width, `{x,y}` lists alternatives."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[:match.start()], match.group(1), pattern[match.end():]
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    items = [str(n).zfill(len(span[1])) for n in range(int(span[1]), int(span[2]) + 1)] if span else body.split(",")
    return [expanded for item in items for expanded in expand_braces(head + item + tail)]


def pattern_files(location: str, role: str, what: str) -> list[str]:
    """A brace or glob pattern's files, in order; a missing one is a UserError naming it as the split's `what`."""
    paths = []
    for part in expand_braces(location):
        found = sorted(glob.glob(part)) if glob.has_magic(part) else [part]
        missing = next((p for p in found if not os.path.isfile(p)), None) if found else part
        if missing is not None:
            how = "is a folder, not a file" if os.path.isdir(missing) else "does not exist"
            raise UserError(f"{role} {what} {missing} {how} (from {location})")
        paths.extend(found)
    return paths


def shard_paths(location: str, role: str) -> list[str]:
    """The shards of a split, in order: a folder's `*.tar` by name, or a pattern's expansion (each part globbed)."""
    if is_pattern(location):
        paths = pattern_files(location, role, "shard")
    else:
        names = sorted(os.listdir(location))
        paths = [os.path.join(location, name) for name in names if name.endswith(".tar")]
        check_numbered(paths, role)
        compressed = next((name for name in names if name.endswith(GZIPPED)), None)
        if not paths and compressed:
            raise UserError(gzip_line(os.path.join(location, compressed), role))
    if not paths:
        raise UserError(f"{role} data {location} holds no .tar shards")
    return paths


NUMBERED = re.compile(r"(.*[-_])(\d+)-of-(\d+)(\.[^/]*)")  # Hugging Face's `train-00003-of-00294.parquet`


def check_numbered(paths: list[str], role: str) -> None:
    """A folder's files named `-NNNNN-of-MMMMM` say how many there are: one missing (a download cut short) is refused,
    naming it, rather than trained without. A pattern's may be a chosen few."""
    groups: dict[tuple[str, str, str, int], set[int]] = {}
    for path in paths:
        match = NUMBERED.fullmatch(path)
        if match:
            groups.setdefault((match[1], match[3], match[4], len(match[2])), set()).add(int(match[2]))
    for (head, total, tail, width), numbers in groups.items():
        missing = next((n for n in range(int(total)) if n not in numbers), None)
        if missing is not None:
            raise UserError(f"{role} file {head}{missing:0{width}d}-of-{total}{tail} is missing ({len(numbers)} of the "
                            f"{int(total)} its siblings' names count are there): was a download cut short?")


def gzip_line(path: str, role: str) -> str:
    return f"{role} shard {path} is gzip-compressed: decompress it (gunzip)"


def gzipped(path: str, entry: Optional[object_store.Entry] = None) -> bool:
    """A shard that begins with gzip's magic bytes, which tarfile's plain reading takes for a bad header."""
    with contextlib.suppress(OSError, UserError):
        if entry:
            return object_store.RangedFile(entry).read(2) == GZIP_MAGIC
        with open(path, "rb") as f:
            return f.read(2) == GZIP_MAGIC
    return False


def split_folder(folder: str) -> Optional[tuple[str, str]]:
    """Train and val shard patterns of a folder of both (timm's imagenet-1k-wds), else None; unclear names refused."""
    try:
        if not object_store.is_url(folder):
            names = os.listdir(folder)
        elif object_store.scheme(folder) in ("http", "https"):  # an https:// URL has none to list
            return None
        else:
            names = [posixpath.basename(e.url) for e in object_store.listing(folder)]
    except OSError:
        return None
    names = sorted(n for n in names if n.endswith(".tar"))
    train = {n for n in names if "train" in n}
    for word in ("validation", "valid", "val"):
        val = {n for n in names if re.search(rf"(^|[-_.]){word}([-_.]|$)", n)}
        if not (train and val):
            continue
        patterns = os.path.join(folder, "*train*.tar"), os.path.join(folder, f"*{word}*.tar")
        unclear = [n for n in names if (n in train) == (n in val)]
        if unclear:
            raise UserError(f"{folder} holds train shards ({min(train - val or train)} ...) and {word} shards "
                            f"({min(val - train or val)} ...), and {unclear[0]}, whose name says "
                            f"{'both' if unclear[0] in train else 'neither'}: name each split's shards with a pattern "
                            f"({', '.join(patterns)})")
        return patterns
    return None


def store_shards(location: str, role: str) -> list[object_store.Entry]:
    """A store split's shards, in order, with size and ETag; each folder listed once (http(s) asks each shard)."""
    if not is_pattern(location):
        if object_store.scheme(location) in ("http", "https"):
            return _indexed_shards(location, role)
        found = [e for e in object_store.listing(location) if e.url.endswith(".tar")]
        if not found:
            raise UserError(f"{role} data {location} holds no .tar shards")
        return found
    listed = functools.lru_cache(maxsize=None)(object_store.listing)  # each folder's entries, by name
    found = []
    for part in expand_braces(location):
        if object_store.scheme(part) in ("http", "https") and not glob.has_magic(part):
            found.append(object_store.info(part))
            continue
        matched = [e for e in listed(posixpath.dirname(part)) if fnmatch.fnmatchcase(e.url, part)]
        if not matched:
            raise UserError(f"{role} shard {part} does not exist (from {location})")
        found.extend(matched)
    return found


def _indexed_shards(folder: str, role: str) -> list[object_store.Entry]:
    """The shards a pack's index names, of a folder that cannot be listed (https://), each asked for size and ETag."""
    beside = object_store.join(folder, INDEX_NAME)
    found = object_store.find(beside)
    if found is None:
        raise UserError(f"{role} data {folder} has no {INDEX_NAME} (an https:// folder cannot be listed): give a "
                        "pack's folder, or name the shards with a brace pattern (https://host/train-{0000..1023}.tar)")
    saved = _read_pack(object_store.cache().local_copy(found), beside, ("shards",))
    if saved is None:
        raise UserError(f"shard index {beside} is of another version: {pack_again(beside)}")
    urls = [str(s) if object_store.is_url(str(s)) else object_store.join(folder, str(s)) for s in saved["shards"]]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(object_store.info, urls))


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
    etags: Optional[tuple[str, ...]] = None  # shards in a store: each object's ETag as listed at start

    def read(self, i: int) -> bytes:
        path = self.shards[int(self.shard[i])]
        start, length = int(self.offsets[i]), int(self.lengths[i])
        try:
            mapped = self.mapped(int(self.shard[i]))
            size = mapped.size()  # the file's now: a shard cut short while mapped would raise SIGBUS, not an error
        except OSError as error:
            raise CorruptImageError(f"cannot read shard {path}: {error.strerror or error}") from None
        except ValueError:  # mmap refuses an empty file: the shard was emptied since it was indexed
            mapped, size = None, 0
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

    def mapped(self, k: int) -> mmap.mmap:
        """Shard k mapped in this process: the file, or a store's shard's whole copy in the node's cache."""
        path = self.shards[k]
        if not object_store.is_url(path):
            return _mapped(path)
        entry = object_store.Entry(path, int(self.sizes[k]), self.etags[k] if self.etags else "")
        try:
            return _mapped(object_store.cache().local_copy(entry), store=True)
        except FileNotFoundError:  # evicted by another process between the look and the open: fetched again
            return _mapped(object_store.cache().local_copy(entry), store=True)

    def changed_bytes(self, i: int) -> str:
        """The line for sample i whose bytes fail its checksum, and what to do about it."""
        path, index = self.shards[int(self.shard[i])], self.index or "its index"
        if self.packed:
            return (f"shard {path} member {self.member(i)} has other bytes than when it was packed (its checksum in "
                    f"{index} differs): the shard changed after it was packed; {pack_again(index)}")
        again = f"remove {self.index} to index the shards again" if self.index else "start again to index them again"
        return (f"shard {path} member {self.member(i)} has other bytes than when it was indexed (its checksum in "
                f"{index} differs): the shard changed since; restore it, or {again}")

    def name(self, i: int) -> str:
        return shown(f"{self.shards[int(self.shard[i])]}:{self.member(i)}")

    def member(self, i: int) -> str:
        """Sample i's image member's name, from the ustar name and prefix fields alone: asked at every read."""
        offset = int(self.offsets[i])
        try:
            mapped = self.mapped(int(self.shard[i]))
        except (OSError, ValueError, UserError):  # ValueError: an emptied shard (read)
            return f"sample #{i} at byte {offset}"
        header = mapped[offset - 512:offset]
        name = header[:100].split(b"\0", 1)[0]
        if header[257:262] == b"ustar" and header[345] != 0:
            name = header[345:500].split(b"\0", 1)[0] + b"/" + name
        return name.decode("utf-8", "surrogateescape")

    def where(self) -> str:
        return f"{self.location} ({counted(len(self.shards), 'shard')})"

    def label_of(self, i: int) -> str:
        """Sample i's label, by its shard, as an error names it."""
        return f"{self.role} shard {self.shards[int(self.shard[i])]}: label {int(self.labels[i])} of sample #{i}"

    def entries(self) -> np.ndarray:
        """`SHARD.tar:MEMBER` of each sample: the headers are read only when two nodes' fingerprints differ."""
        names = [os.path.basename(p) for p in self.shards]
        return np.array([os.fsencode(f"{names[int(self.shard[i])]}:{self.member(i)}") for i in range(len(self))])

    def sample_columns(self) -> tuple[np.ndarray, ...]:
        """Each sample's shard (by name), where its image lies in it and how long it is, and its label."""
        names = np.array([os.fsencode(os.path.basename(p)) for p in self.shards])
        return names[self.shard], self.offsets, self.lengths, self.labels

    def fingerprint(self) -> FileList:
        """The index's own arrays: no entry strings are built at every start."""
        names = np.array([os.fsencode(os.path.basename(p)) for p in self.shards])
        versions = () if self.etags is None else (np.array([e.encode() for e in self.etags]),)
        return FileList(len(self), len(self.classes), digest_of(self.classes, names, self.sizes, self.shard,
                                                                self.offsets, self.lengths, self.labels, *versions))

    def describe(self) -> str:
        how = "index written by pack" if self.packed else "index from the cache" if self.cached else ""
        unverified = ", no checksums" if how and self.checksums is None else ""
        return f"{len(self)} in {self.where()}" + (f" ({how}{unverified})" if how else "")

    def keep(self, cache_dir: str) -> None:
        if not self.cached:  # a pack's index is read, never walked: cached
            write_index(self, cache_path(cache_dir, self.role), relative_to=None)


_MAPS: dict[str, mmap.mmap] = {}
_STORE_MAPS: OrderedDict[str, mmap.mmap] = OrderedDict()  # a store's shards, most recently used last
STORE_MAPS = 8  # of those a process keeps mapped: one the cache evicted frees its disk once unmapped
os.register_at_fork(after_in_child=_MAPS.clear)  # a forked worker maps its own
os.register_at_fork(after_in_child=_STORE_MAPS.clear)


def _mapped(path: str, store: bool = False) -> mmap.mmap:
    """This process's read-only map of a shard; `store`: a store's cached shard (the STORE_MAPS last used)."""
    maps = _STORE_MAPS if store else _MAPS
    if path not in maps:
        with open(path, "rb") as f:
            maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if store:
        _STORE_MAPS.move_to_end(path)
        while len(_STORE_MAPS) > STORE_MAPS:
            _STORE_MAPS.popitem(last=False)[1].close()
    return maps[path]


def _header_size(mapped: mmap.mmap, data_offset: int) -> Optional[int]:
    """The size field of the tar header right before a member's data (None if it cannot be read)."""
    octal = mapped[data_offset - 512 + 124:data_offset - 512 + 136]
    try:
        return int(octal.rstrip(b"\0 ").strip() or b"0", 8)
    except ValueError:  # base-256 sizes (members of 8 GB and more) or not a header
        return None


# ----------------------------------------------------------------------------- the index on disk

def cache_path(cache_dir: str, role: str) -> str:
    return os.path.join(cache_dir, f"index-{role}-shards.npz")


def write_index(source: TarShards, path: str, relative_to: Optional[str]) -> None:
    """The index as one .npz, written atomically; shard paths relative to `relative_to` (pack's), else absolute."""
    arrays = {name: getattr(source, name) for name in (*INDEX_ARRAYS, *OPTIONAL_ARRAYS)}
    arrays["shards"] = [os.path.relpath(p, relative_to) if relative_to else _absolute(p) for p in source.shards]
    index_file.write(path, INDEX_VERSION, location=np.array(_absolute(source.location)),
                     **{name: np.asarray(value) for name, value in arrays.items() if value is not None})


def _absolute(path: str) -> str:
    return path if object_store.is_url(path) else os.path.abspath(path)


def _read_pack(path: str, named: str, names: tuple[str, ...] = INDEX_ARRAYS) -> Optional[dict[str, np.ndarray]]:
    """A pack's index file (at `path`, a local copy of `named` for a store's): one numpy cannot read is refused."""
    try:
        return index_file.read(path, INDEX_VERSION, names, OPTIONAL_ARRAYS)
    except index_file.Unreadable as error:
        raise UserError(f"shard index {str(error).replace(path, named)}: {pack_again(named)}") from None


def read_index(path: str, location: str, role: str, shards: list[str], packed: bool,
               named: Optional[str] = None) -> Optional[TarShards]:
    """The index at `path` if it is of these shards (else None for a cache, an error for a pack's). `named`: the
    index's own place where `path` is a local copy of it, which its relative shard names are relative to."""
    named = named or path
    saved = _read_pack(path, named) if packed else index_file.read(path, INDEX_VERSION, INDEX_ARRAYS, OPTIONAL_ARRAYS)
    if saved is None:
        return None
    folder = os.path.dirname(named)  # what relative shard names are relative to (a URL's too: object_store.join)
    listed = [s if object_store.is_url(s) else _absolute(os.path.join(folder, s)) for s in map(str, saved["shards"])]
    current = [_absolute(p) for p in shards]
    if listed != current:
        if packed:
            extra = sorted(set(listed) ^ set(current))  # none: the same shards in another order
            differs = f"other shards than {location} holds ({extra[0]})" if extra else \
                f"the shards of {location} in another order ({len(listed)} entries for {len(set(listed))} shards)"
            raise UserError(f"shard index {named} lists {differs}: was the pack changed after it was written?")
        return None
    fields = {**saved, "shards": tuple(shards), "classes": tuple(str(c) for c in saved["classes"])}
    if "etags" in saved:
        fields["etags"] = tuple(str(e) for e in saved["etags"])
    return TarShards(location, role, cached=True, packed=packed, index=named, **fields)


def pack_record(folder: str) -> Optional[dict]:
    """A folder's pack.json (a store's too), or None where it has none readable."""
    if object_store.is_url(folder):
        found = object_store.listed(object_store.join(folder, PACK_FILE))
        return as_pack_record(object_store.read_whole(found.url)) if found else None
    try:
        with open(os.path.join(folder, PACK_FILE), "rb") as f:
            return as_pack_record(f.read())
    except OSError:
        return None


def as_pack_record(data: bytes) -> Optional[dict]:
    """pack.json's bytes as the record `pack` writes (a JSON object), or None: damaged, or JSON of another shape."""
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def check_pack_finished(location: str, role: str, root: str) -> None:
    """Shards of a pack `pack` has not finished writing or uploading (its pack.json, written first, says so) are
    refused: read as shards from elsewhere, they would train on what it had written so far, silently."""
    record = pack_record(root)
    if record is not None and record.get("complete") is False:
        raise UserError(f"{role} data {location} is part of a pack that `imagenet-elastic pack` did not finish "
                        f"({os.path.join(root, PACK_FILE)}): run `{pack_command(record, root, continuing=True)}` "
                        "again to finish it")


def pack_command(record: Optional[dict], out: str, continuing: bool = False) -> str:
    """The `imagenet-elastic pack` command that wrote pack.json's `record`, to OUT `out`, quoted for a shell: every
    option it recorded (`--quality` only with `--max-side` for a new OUT, where it changes nothing, but pack continues
    an OUT only with the same options)."""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):  # none, or not what pack writes
        options = {**(record.get("options") or {}), "val_path": record.get("val_path"),
                   "val_labels": record.get("val_labels")}
        flags = [word for k, v in options.items()
                 if v is not None and (continuing or k != "quality" or options.get("max_side") is not None)
                 for word in (f"--{k.replace('_', '-')}", str(v))]
        return shlex.join(["imagenet-elastic", "pack", str(record.get("source", "SRC")), out, *flags])
    return shlex.join(["imagenet-elastic", "pack", "SRC", out])


def pack_again(index: str) -> str:
    """How to get a pack whose index holds: its command again (from pack.json, where it is), or a walk at start."""
    command = pack_command(pack_record(os.path.dirname(os.path.dirname(os.path.abspath(index)))), "NEW_OUT")
    return f"pack again ({command}), or remove {index} to index the shards at start"


# ----------------------------------------------------------------------------- walking the tar headers

def split_name(member: str) -> tuple[str, str]:
    """WebDataset's key and extension: the name up to the first dot of its last part, and the rest."""
    folder, _, base = member.rpartition("/")
    stem, dot, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension.lower() if dot else ""


def sample_member(fields: dict[str, tarfile.TarInfo], kinds: tuple[str, ...]) -> Optional[tarfile.TarInfo]:
    """A sample's member of the first of `kinds` (its members by extension): by the whole extension, else by its last
    part, as webdataset's decoders take the `x.jpg` of `KEY.x.jpg` (a key written with a dot in it) for an image."""
    by_last_part = {extension.rpartition(".")[2]: member for extension, member in reversed(fields.items())}
    return next((found[kind] for found in (fields, by_last_part) for kind in kinds if kind in found), None)


@dataclass
class Found:
    """One shard's walk, sample by sample; equal: the same headers and labels (all a walk without checksums tells)."""

    offsets: list[int]
    lengths: list[int]
    labels: list[int]
    checksums: Optional[list[int]] = field(default=None, compare=False)  # each image's CRC-32, where the walk read it


def walk_shard(path: str, role: str, checksums: bool = False, entry: Optional[object_store.Entry] = None) -> Found:
    """Every sample of one shard, in order; a UserError naming shard and sample for anything wrong. `checksums`: read
    each image's bytes for its CRC-32 (the whole shard); `entry`: a store's shard, by ranged reads (no checksums)."""
    found = Found([], [], [], [] if checksums else None)
    key: Optional[str] = None
    try:
        size = entry.size if entry else os.stat(path).st_size
        with tarfile.open(path, "r:", fileobj=object_store.RangedFile(entry) if entry else None) as tar:
            named = ((m, *split_name(m.name)) for m in tar if m.isfile())
            for key, members in itertools.groupby(named, operator.itemgetter(1)):
                fields: dict[str, tarfile.TarInfo] = {}  # images and labels by extension; other files are not ours
                for member, _, extension in members:
                    if extension in fields:
                        raise UserError(f"{role} shard {path}: sample {key} has a second {member.name} (a key "
                                        "repeated in consecutive members): give each sample its own key")
                    if extension.rpartition(".")[2] in (*IMAGE_EXTENSIONS, LABEL_EXTENSION):
                        fields[extension] = member
                image, labelled = (sample_member(fields, kinds) for kinds in (IMAGE_EXTENSIONS, (LABEL_EXTENSION,)))
                if image is None and labelled is None:  # not a sample (another file kept in the shard)
                    continue
                label = None
                if labelled is not None:
                    stream = tar.extractfile(labelled)
                    text = stream.read(64).decode("utf-8", "replace").strip() if stream is not None else ""
                    try:
                        label = int(text)
                    except ValueError:
                        raise UserError(f"{role} shard {path}: the label of sample {key} ({labelled.name}) is "
                                        f"{text[:20]!r}, not an integer") from None
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
            check_end(tar)
    except tarfile.TarError as error:
        if not key and gzipped(path, entry):
            raise UserError(gzip_line(path, role)) from None
        after = f" after sample {key}" if key else ""
        raise UserError(f"{role} shard {path} is truncated or not a tar file{after}: {error}") from None
    except OSError as error:
        raise UserError(f"cannot read {role} shard {path}: {error.strerror or error}") from None
    if not found.labels:
        raise UserError(f"{role} shard {path} holds no samples (KEY.jpg with KEY.cls)")
    return found


def check_end(tar: tarfile.TarFile) -> None:
    """A walked archive ends in its end-of-archive marker (two zero blocks, which every tar writer writes): tarfile
    takes a shard cut at a member's end for a whole one. One read (for a store's shard at most one ranged read)."""
    tar.fileobj.seek(tar.offset)  # where tarfile stopped: the marker's place
    if tar.fileobj.read(2 * tarfile.BLOCKSIZE) != tarfile.NUL * (2 * tarfile.BLOCKSIZE):
        raise tarfile.ReadError(f"no end-of-archive marker at byte {tar.offset}")


def class_names(location: str, shards: list[str]) -> Optional[tuple[str, ...]]:
    """classes.txt in the shards' folder or the one above it, else an _info.json's list there, if any."""
    folder = os.path.dirname(shards[0]) if is_pattern(location) else location  # a store's URL too (object_store.join)
    for where in (folder, os.path.dirname(folder)):
        candidate, info = os.path.join(where, CLASSES_FILE), os.path.join(where, INFO_FILE)
        if (text := _text(candidate)) is not None:
            lines = text.lstrip("\ufeff").rstrip("\r\n").splitlines()  # a BOM is no name; spaces are part of one
            if not lines or "" in lines:  # a blank line inside would shift every name after it by one
                raise UserError(f"classes file {candidate} is empty" if not lines else
                                f"classes file {candidate}: line {lines.index('') + 1} is blank (a name a line, in "
                                "label order)")
            return tuple(lines)
        if (text := _text(info)) is not None:
            try:
                described = json.loads(text)
            except ValueError as error:
                raise UserError(f"{info} is not readable JSON: {error}") from None
            listed = next((described[k] for k in INFO_NAME_KEYS if isinstance(described, dict) and k in described),
                          None)
            if listed is not None:
                if not (isinstance(listed, list) and listed and all(isinstance(name, (str, int)) for name in listed)):
                    raise UserError(f"{info}: its class names are not a list of names ({str(listed)[:40]!r})")
                return tuple(str(name) for name in listed)
    return None


def _text(path: str) -> Optional[str]:
    """A small file's UTF-8 text, on disk or in a store; None where there is none."""
    if object_store.is_url(path):
        data = object_store.read_whole(path) if object_store.find(path) else None
    else:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as error:
            raise UserError(f"cannot read {shown(path)}: {error.strerror or error}") from None
    try:
        return None if data is None else data.decode()
    except UnicodeDecodeError as error:
        raise UserError(f"{shown(path)} is not UTF-8 text (byte {error.start})") from None


def walk(location: str, role: str, classes: Optional[tuple[str, ...]] = None,
         entries: Optional[list[object_store.Entry]] = None, paths: Optional[list[str]] = None) -> TarShards:
    """Index the shards of `location` (`paths`, where the caller listed them) by walking their headers, each image's
    checksum taken; a store's (`entries`) by ranged reads, eight shards at a time (each a round trip), no checksums."""
    if entries:
        with ThreadPoolExecutor(8) as pool:
            found = list(pool.map(lambda e: walk_shard(e.url, role, entry=e), entries))
        return assemble(location, role, [e.url for e in entries], found, classes, entries)
    paths = paths or shard_paths(location, role)
    return assemble(location, role, paths, [walk_shard(p, role, checksums=True) for p in paths], classes)


def assemble(location: str, role: str, paths: list[str], per_shard: list[Found],
             classes: Optional[tuple[str, ...]] = None,
             entries: Optional[list[object_store.Entry]] = None) -> TarShards:
    """The index of walked shards, with checksums where every walk took them; `entries`: a store's (no mtimes)."""
    named = class_names(location, paths)
    stats = [(e.size, 0) for e in entries] if entries else [(s.st_size, s.st_mtime_ns) for s in map(os.stat, paths)]
    sizes, mtimes = (np.array(column, dtype=np.int64) for column in zip(*stats))

    def joined(field: str, dtype: type) -> Optional[np.ndarray]:  # None: a shard walked without them (checksums)
        columns = [getattr(f, field) for f in per_shard]
        return None if any(c is None for c in columns) else np.concatenate([np.array(c, dtype=dtype) for c in columns])

    source = TarShards(location, role, tuple(paths), sizes, mtimes, (), joined("labels", np.int64),
                       np.concatenate([np.full(len(f.labels), k, dtype=np.int32) for k, f in enumerate(per_shard)]),
                       joined("offsets", np.int64), joined("lengths", np.int64),
                       checksums=joined("checksums", np.uint32),
                       etags=tuple(e.etag for e in entries) if entries else None)
    return replace(source, classes=checked_classes(source.labels, source.label_of, named, classes,
                                                   "the classes file lists",
                                                   f"shards without class names ({CLASSES_FILE} or {INFO_FILE})"))


# ----------------------------------------------------------------------------- an index held against its shards

def check_shards(source: TarShards, classes: Optional[tuple[str, ...]] = None) -> TarShards:
    """The index `source` if its shards are still the ones it describes, by a `stat` of each (a digest or a walk would
    read the whole split at every start): any write changes the mtime. A shard of another mtime (a copy that did not
    keep them: `cp -r`, most downloads) has its headers and labels walked and compared, same-size changes in place
    left to the checksums (TarShards.read). A pack's index is a promise: another size or samples is refused, other
    mtimes with the same headers kept with a note; a cache of shards from elsewhere is rebuilt, with a note."""
    try:
        stats = [os.stat(p) for p in source.shards]
    except OSError as error:
        raise UserError(f"cannot read {source.role} shard {shown(error.filename)}: {error.strerror or error}") from None
    resized = [k for k, stat in enumerate(stats) if stat.st_size != int(source.sizes[k])]
    touched = [k for k, stat in enumerate(stats) if k not in resized and stat.st_mtime_ns != int(source.mtimes[k])]
    if source.packed and resized:
        raise resized_shard(source, resized[0], stats[resized[0]].st_size)
    if not resized and not touched:
        return source
    start = time.perf_counter()
    walked = {k: walk_shard(source.shards[k], source.role) for k in (*resized, *touched)}
    seconds = time.perf_counter() - start
    changed = [k for k in sorted(walked) if walked[k] != indexed_samples(source, k)]
    if source.packed:
        if changed:
            k = changed[0]
            raise UserError(f"shard {source.shards[k]} differs from its index {source.index} "
                            f"({first_difference(indexed_samples(source, k), walked[k])}): it was changed after it "
                            f"was packed; {pack_again(source.index)}")
        tells = ("; each sample's checksum, compared as it is read, stops the run at a changed one"
                 if source.checksums is not None else
                 ", which this index cannot tell apart (it has no checksums: pack again to have them)")
        return replace(source, notes=(
            f"{len(touched)} shards of {source.location} have other mtimes than its index records and the same "
            "members: a copy that did not keep mtimes (`cp -a` or `rsync -a` keep them), or bytes changed in "
            f"place{tells}; checking their headers took {seconds:.1f} s",))
    if not changed:  # touched alone: the index holds, with the shards' mtimes of now
        return replace(source, sizes=np.array([stat.st_size for stat in stats], dtype=np.int64),
                       mtimes=np.array([stat.st_mtime_ns for stat in stats], dtype=np.int64), cached=False)
    if source.checksums is not None:  # the rebuilt index keeps them: the changed shards' bytes are read for theirs
        walked = {k: walk_shard(source.shards[k], source.role, checksums=True) for k in changed}
    return reindexed(source, changed, walked, classes)


def reindexed(source: TarShards, changed: list[int], walked: dict[int, Found], classes: Optional[tuple[str, ...]],
              entries: Optional[list[object_store.Entry]] = None) -> TarShards:
    """The index with the `changed` shards' new walks in place of what it held of them, said in a note."""
    found = [walked[k] if k in changed else indexed_samples(source, k) for k in range(len(source.shards))]
    rebuilt = assemble(source.location, source.role, list(source.shards), found, classes, entries)
    others = f" (and {len(changed) - 1} other shards)" if len(changed) > 1 else ""
    return replace(rebuilt, index=source.index,
                   notes=(f"shard {source.shards[changed[0]]}{others} changed since it was indexed: indexed again",))


def resized_shard(source: TarShards, k: int, size: int) -> UserError:
    """A pack's shard k, now of `size` bytes, where its index says otherwise: refused, naming it."""
    return UserError(f"shard {source.shards[k]} has {size} bytes but its index {source.index} says "
                     f"{int(source.sizes[k])}: the shard was replaced or cut short after it was packed; "
                     f"{pack_again(source.index)}")


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
    """The shards at `location`: pack's index beside them, else the one kept in `cache_dir`, each held against the
    shards (a store's against their listing); else a walk of their headers, to be kept there."""
    if labels_file is not None:
        raise UserError(f"--val-labels is for a flat folder of images, but {location} holds tar shards (their "
                        f".{LABEL_EXTENSION} members are the labels)")
    both = None if is_pattern(location) else split_folder(location)  # a folder of train and val shards side by side
    location = location if both is None else both[0] if role == "train" else both[1]
    entries = store_shards(location, role) if object_store.is_url(location) else None
    shards = [e.url for e in entries] if entries else shard_paths(location, role)
    beside = os.path.join(os.path.dirname(shards[0]), INDEX_NAME)  # a URL's too (object_store.join)
    if entries:  # `pack` uploads a split's index after every shard: a split without one may be an upload cut short
        found, root = object_store.find(beside), posixpath.dirname(posixpath.dirname(shards[0]))
        if found is None and object_store.is_url(root):  # shards at a bucket's top have no folder above
            check_pack_finished(location, role, root)
        packed = object_store.cache().local_copy(found) if found else None  # the local copy of a store's
    else:
        check_pack_finished(location, role, os.path.dirname(os.path.dirname(os.path.abspath(shards[0]))))
        packed = beside if os.path.isfile(beside) else None
    kept = cache_path(cache_dir, role) if cache_dir else None
    index, notes = packed or kept, ()
    try:
        source = read_index(index, location, role, shards, bool(packed), beside if packed else None) if index else None
    except index_file.Unreadable as error:  # the kept one's: a pack's is refused
        source, notes = None, (f"the shard index cache {error}: the shards were indexed again",)
    # names beside kept shards on disk, which may have changed since (a store's kept index: two requests, not six)
    named = class_names(location, shards) if source is not None and not packed and not entries else None
    if named is not None and _named(replace(source, classes=named), classes).classes != source.classes:
        check_range(source.labels, source.label_of, len(named), "the class names beside its shards list")
        source = replace(source, classes=named, cached=False, notes=(
            "the class names beside the shards changed since they were indexed: the new names were taken",))
    if source is None:
        source = replace(walk(location, role, classes, entries, shards), index=kept, notes=notes)
    elif entries:
        source = check_store_shards(source, entries, classes)
    else:
        source = check_shards(source, classes)
    if entries:
        short = object_store.short_cache_note(object_store.settings(), sum(e.size for e in entries), location)
        source = replace(source, notes=(*source.notes, short)) if short else source
    return _named(source, classes)


def _named(source: TarShards, classes: Optional[tuple[str, ...]]) -> TarShards:
    """A split that numbers its labels takes the training split's names for them."""
    if classes is None or source.classes == classes or source.classes != tuple(map(str, range(len(source.classes)))):
        return source
    check_range(source.labels, source.label_of, len(classes), f"{whose(classes)} has")
    return replace(source, classes=classes)


def check_store_shards(source: TarShards, entries: list[object_store.Entry],
                       classes: Optional[tuple[str, ...]] = None) -> TarShards:
    """The index of a store's shards, held against their listing: a pack's (sizes, no ETags) refuses a shard of
    another size; a cached one (ETags) has a changed shard walked again and is rebuilt, said in a note."""
    resized = [k for k, e in enumerate(entries) if e.size != int(source.sizes[k])]
    if source.packed:
        if resized:
            raise resized_shard(source, resized[0], entries[resized[0]].size)
        return replace(source, etags=tuple(e.etag for e in entries))
    changed = [k for k, e in enumerate(entries) if k in resized or source.etags is None or source.etags[k] != e.etag]
    if not changed:
        return source
    walked = {k: walk_shard(entries[k].url, source.role, entry=entries[k]) for k in changed}
    return reindexed(source, changed, walked, classes, entries)
