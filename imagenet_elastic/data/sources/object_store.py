"""Shards in an object store (`s3://`, `gs://`, `https://`) through fsspec (s3fs, gcsfs, aiohttp: the `[s3]`, `[gcs]`
and `[https]` extras): listing, ranged reads, and a node-local cache of whole shards (docs/DATA.md, "Object stores").

Endpoint and credentials are where those libraries look: this module never reads, prints or keeps them. Its settings
are the node's, not the run's (they change no result): environment variables. Whole shards, in a few large ranged GETs
once per node per epoch, where per-sample reads would take a round trip per image; LRU eviction unlinks files readers
may still have mapped, which Linux keeps until they unmap them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import hashlib
import itertools
import math
import os
import posixpath
import random
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from imagenet_elastic.errors import UserError

SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}  # scheme: package
EXTRAS = {"s3fs": "s3", "gcsfs": "gcs", "aiohttp": "https"}  # package: the extra that installs it
_URL = re.compile(f"({'|'.join(SCHEMES)})://", re.IGNORECASE)
CHUNK = 16 << 20  # bytes per ranged GET of a whole-shard fetch
RANGE = 64 << 10  # bytes per ranged GET of a header walk (RangedFile)


class StoreUnavailable(UserError):
    """The store did not answer within IMAGENET_ELASTIC_STORE_TIMEOUT: the run ends, its last checkpoint kept."""

    every_rank = True
    exit_code = 69  # EX_UNAVAILABLE


def is_url(location: str) -> bool:
    return bool(_URL.match(location))


def scheme(url: str) -> str:
    return url.split("://", 1)[0].lower()


def join(url: str, *parts: str) -> str:
    """`url` and `parts` joined by slashes, never normalised (`s3://` keeps both): os.path.join's result on POSIX."""
    return posixpath.join(url, *parts)


# ----------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class Settings:
    cache: str  # the node-local folder of whole shards
    cache_bytes: Optional[int]  # its cap; None: the file system's, keeping 10% of it free
    timeout: float  # seconds without an answer before StoreUnavailable


def settings(environ: Optional[dict] = None) -> Settings:
    """The store's settings from the environment (module docstring); a bad value is a UserError naming it."""
    environ = os.environ if environ is None else environ
    cache = environ.get("IMAGENET_ELASTIC_STORE_CACHE") or os.path.join(
        environ.get("TMPDIR") or "/tmp", "imagenet-elastic-store-cache")
    return Settings(cache, _number(environ, "IMAGENET_ELASTIC_STORE_CACHE_GB", 2 ** 30),
                    _number(environ, "IMAGENET_ELASTIC_STORE_TIMEOUT", 1) or 300.0)


def _number(environ: dict, name: str, unit: float) -> Optional[float]:
    """The variable's positive, finite number (float() also reads `nan` and `inf`) in `unit`s; None where unset."""
    text = environ.get(name)
    if not text:
        return None
    with contextlib.suppress(ValueError):
        value = float(text)
        if 0 < value < math.inf:  # False for nan too
            return int(value * unit) if unit > 1 else value
    raise UserError(f"{name}={text!r} is not a positive number")


# ----------------------------------------------------------------------------- the client

_FILESYSTEMS: dict[tuple, object] = {}
_CLIENT_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                     "GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")  # a client made under others differs


def filesystem(url: str, timeout: float):
    """This process's fsspec file system for `url`'s scheme (made at first use: fsspec's event loop does not survive
    a fork). Each request is bounded by `timeout` and attempted once, to be retried by `patiently`, not waited on in
    the libraries' nested retry loops (s3fs's two around botocore's)."""
    key = (os.getpid(), scheme(url), timeout, *(os.environ.get(name) for name in _CLIENT_VARIABLES))
    if key in _FILESYSTEMS:
        return _FILESYSTEMS[key]
    package = SCHEMES[scheme(url)]
    try:
        import fsspec

        __import__(package)
    except ImportError:
        raise UserError(f"{url}: reading {scheme(url)}:// needs {package}: pip install "
                        f"'imagenet-elastic[{EXTRAS[package]}]'") from None
    per_request = max(1.0, min(30.0, timeout / 3))
    if package == "s3fs":
        made = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs={
            "connect_timeout": per_request, "read_timeout": per_request,
            "retries": {"total_max_attempts": 1, "mode": "standard"}})
        made.retries = 1  # s3fs's own loops around botocore's: retries and the deadline are `patiently`'s
    elif package == "aiohttp":
        import aiohttp

        made = fsspec.filesystem("http", skip_instance_cache=True, client_kwargs={
            "timeout": aiohttp.ClientTimeout(total=None, sock_connect=per_request, sock_read=per_request)})
    elif os.environ.get("STORAGE_EMULATOR_HOST", "") not in ("", "default"):  # gcsfs's JSON-API class, anonymous:
        from gcsfs.core import GCSFileSystem  # the default asks a bucket's layout over gRPC, which emulators lack

        made = GCSFileSystem(token="anon", timeout=per_request, skip_instance_cache=True)
    else:  # gcsfs's `timeout` bounds a call, its retries included
        made = fsspec.filesystem("gcs", skip_instance_cache=True, timeout=per_request)
    _FILESYSTEMS[key] = made
    return made


T = TypeVar("T")


def patiently(what: str, call: Callable[[], T], timeout: float, sleep: Callable[[float], None] = time.sleep,
              clock: Callable[[], float] = time.monotonic) -> T:
    """`call()`, retried on a store's transient failures until it has failed for `timeout` seconds in a row."""
    rng = random.Random()  # jitter only: no result depends on it
    first_failure: Optional[float] = None
    for attempt in itertools.count():
        try:
            return answered(call)
        except (UserError, MemoryError):
            raise
        except FileNotFoundError:
            raise UserError(f"{what} does not exist (no such bucket or object)") from None
        except transient() as error:  # a time-out, a reset, a 5xx, throttling: the store's, for a while
            if refused(error):
                raise UserError(f"{what}: access refused ({_reason(error)}): check the store's credentials") from None
            now = clock()
            loader = sys.modules.get("torch.utils.data")  # a DataLoader worker's many reads would each say so
            if first_failure is None and not (loader and loader.get_worker_info()):  # a wait at start-up says why
                print(f"warning: the store did not answer for {what} ({_reason(error)}): retrying for up to "
                      f"{timeout:g} s (IMAGENET_ELASTIC_STORE_TIMEOUT)", file=sys.stderr, flush=True)
            first_failure = now if first_failure is None else first_failure
            if now - first_failure >= timeout:
                raise StoreUnavailable(f"the store did not answer for {what} for {timeout:g} s "
                                       f"({_reason(error)}): run again with --resume once it is back") from None
            # full jitter over 0.5 s doubling (at most 20 s): a node's workers that failed together retry apart
            sleep(min(rng.uniform(0, min(20.0, 0.5 * 2 ** attempt)), max(0.0, first_failure + timeout - now)))


def answered(call: Callable[[], T]) -> T:
    """`call()`, raising the cause of a FileNotFoundError that was no 404: fsspec's https:// file system raises a
    refused connection, a time-out and a 5xx as one, and a store out of reach is retried, not a missing object."""
    try:
        return call()
    except FileNotFoundError as error:
        cause = error.__cause__
        if cause is None or isinstance(cause, FileNotFoundError) or not_found(cause) \
                or not isinstance(cause, transient()):
            raise
        raise cause from None


def not_found(cause: BaseException) -> bool:
    """A 404 as aiohttp says it (`status`) or botocore does (the ClientError s3fs raises a missing object from)."""
    response = getattr(cause, "response", None)
    response = response if isinstance(response, dict) else {}
    code = str(response.get("Error", {}).get("Code", ""))
    return 404 in (getattr(cause, "status", None), response.get("ResponseMetadata", {}).get("HTTPStatusCode")) \
        or code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound")


def transient() -> tuple[type[BaseException], ...]:
    """What a client raises when the store is away for a while: connection errors and time-outs (the libraries' own
    classes are not OSErrors), and answers other than FileNotFoundError or PermissionError (5xx, throttling)."""
    found: list[type[BaseException]] = [OSError, TimeoutError, asyncio.TimeoutError]
    for module, names in (("botocore.exceptions", ("BotoCoreError", "ClientError")), ("aiohttp", ("ClientError",)),
                          ("fsspec.exceptions", ("FSTimeoutError",)), ("gcsfs.retry", ("HttpError",))):
        loaded = sys.modules.get(module)  # imported by the client in use, if at all: never imported here
        found.extend(getattr(loaded, name) for name in names if hasattr(loaded, name))
    return tuple(found)


def refused(error: BaseException) -> bool:
    """The store refused the credentials (PermissionError, a 401 or 403, gcsfs's "Forbidden: ..."): retrying would
    only wait. aiohttp's `code` is a deprecated alias of `status`: read last."""
    answer = getattr(error, "status", None) or getattr(error, "code", None)
    return isinstance(error, PermissionError) or answer in (401, 403) or str(error).startswith("Forbidden")


def _reason(error: BaseException) -> str:
    """An error's text for a line a user reads: the endpoint (an address of the user's network) left out."""
    text = re.sub(r"\b[a-z][a-z0-9+.-]*://[^\s\"']+", "the endpoint", " ".join(str(error).split()))
    return (text or type(error).__name__)[:160]


@dataclass(frozen=True)
class Entry:
    """An object as the store describes it."""

    url: str
    size: int
    etag: str  # the store's version of it ("" where the store gives none)


def describe(url: str, info: dict) -> Entry:
    etag = next((str(info[k]) for k in ("ETag", "etag", "md5Hash", "generation") if info.get(k)), "")
    return Entry(url, int(info.get("size") or 0), etag.strip('"'))


def _ask(url: str, timeout: Optional[float], request: Callable[[Any, str], T]) -> T:
    """`request(fs, path)` on `url`'s file system, retried as `patiently` says; `timeout`: the node's where None.
    `path` is what fsspec's file system of the scheme takes: the URL itself for http(s), else without the scheme."""
    timeout = settings().timeout if timeout is None else timeout
    fs, path = filesystem(url, timeout), url if scheme(url) in ("http", "https") else url.split("://", 1)[1]
    return patiently(url, lambda: request(fs, path), timeout)


def info(url: str, timeout: Optional[float] = None) -> Entry:
    return describe(url, _ask(url, timeout, lambda fs, path: fs.info(path)))


def find(url: str, timeout: Optional[float] = None) -> Optional[Entry]:
    """The object at `url`, or None where there is none (a store that does not answer is not "none")."""

    def request(fs: Any, path: str) -> Optional[dict]:
        with contextlib.suppress(FileNotFoundError):
            return answered(lambda: fs.info(path))
        return None

    found = _ask(url, timeout, request)
    return None if found is None or found.get("type") == "directory" else describe(url, found)


def isdir(url: str, timeout: Optional[float] = None) -> bool:
    """A prefix with objects under it (a store's folder); http(s) has none to list."""
    return scheme(url) not in ("http", "https") and _ask(url, timeout, lambda fs, path: fs.isdir(path.rstrip("/")))


def listed(url: str, timeout: Optional[float] = None) -> Optional[Entry]:
    """The object at `url` as its folder's listing shows it, or None: one request, where `find` of an absent object
    takes two (s3fs then asks for a folder of its name); http(s), which cannot list, is asked for the object."""
    if scheme(url) in ("http", "https"):
        return find(url, timeout)
    return next((e for e in listing(posixpath.dirname(url), timeout) if e.url == url), None)


def listing(folder: str, timeout: Optional[float] = None) -> list[Entry]:
    """The objects right under `folder`, by name, with size and ETag: one LIST a thousand objects, no HEAD each."""
    if scheme(folder) in ("http", "https"):
        raise UserError(f"{folder}: an https:// location cannot be listed: name its shards with a brace pattern "
                        "(https://host/train-{0000..1023}.tar), or give a pack's folder (its index lists them)")
    found = _ask(folder, timeout, lambda fs, path: fs.ls(path.rstrip("/"), detail=True, refresh=True))
    prefix = scheme(folder) + "://"
    return sorted((describe(prefix + f["name"], f) for f in found if f.get("type") == "file"), key=lambda e: e.url)


def read_range(url: str, start: int, end: int, timeout: Optional[float] = None) -> bytes:
    """Bytes [start, end) of an object; an answer of another length (range ignored) is retried, never taken."""

    def request(fs: Any, path: str) -> bytes:
        data = fs.cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise OSError(f"asked bytes {start}-{end - 1}, got {len(data)} bytes")
        return data

    return _ask(url, timeout, request)


def read_whole(url: str, timeout: Optional[float] = None) -> bytes:
    return _ask(url, timeout, lambda fs, path: fs.cat_file(path))


def write_file(local: str, url: str, timeout: Optional[float] = None) -> None:
    """A local file to the object at `url` (a multipart upload where the library makes one), retried as reads are."""
    _ask(url, timeout, lambda fs, path: fs.put_file(local, path))


def write_bytes(data: bytes, url: str, timeout: Optional[float] = None) -> None:
    """`data` as the object at `url`, retried as reads are."""
    _ask(url, timeout, lambda fs, path: fs.pipe_file(path, data))


class RangedFile:
    """A read-only file over an object, by ranged reads of RANGE bytes (a tar header and its label in one read)."""

    def __init__(self, entry: Entry) -> None:
        self.entry, self.timeout = entry, settings().timeout
        self.position, self.cached_at, self.cached = 0, 0, b""

    def read(self, size: int = -1) -> bytes:
        end = self.entry.size if size is None or size < 0 else min(self.entry.size, self.position + size)
        out = bytearray()
        while self.position < end:
            if not self.cached_at <= self.position < self.cached_at + len(self.cached):
                fetch_end = min(self.entry.size, max(end, self.position + RANGE))
                self.cached = read_range(self.entry.url, self.position, fetch_end, self.timeout)
                self.cached_at = self.position
            piece = self.cached[self.position - self.cached_at:end - self.cached_at]
            out += piece
            self.position += len(piece)
        return bytes(out)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = offset if whence == 0 else self.position + offset if whence == 1 else self.entry.size + offset
        return self.position

    def tell(self) -> int:
        return self.position


# ----------------------------------------------------------------------------- the node-local cache

@dataclass(frozen=True)
class ShardCache:
    """Whole shards in the node-local folder settings.cache, named by URL and ETag (a changed object is a new file)."""

    settings: Settings

    def path(self, entry: Entry) -> str:
        digest = hashlib.blake2b(f"{entry.url}\0{entry.etag}\0{entry.size}".encode(), digest_size=12).hexdigest()
        return os.path.join(self.settings.cache, f"{digest}-{posixpath.basename(entry.url)}")

    def local_copy(self, entry: Entry) -> str:
        """The path of the whole shard on this node: there already (use recorded for eviction), or fetched now."""
        path = self.path(entry)
        if _whole(path, entry.size):
            with contextlib.suppress(OSError):
                os.utime(path)  # its use, for eviction
            return path
        try:
            os.makedirs(self.settings.cache, exist_ok=True)
            with _locked(path + ".lock"):
                if not _whole(path, entry.size):
                    for stale in glob.glob(glob.escape(path) + ".part-*"):  # a killed fetch's: the lock is ours
                        Path(stale).unlink(missing_ok=True)
                    self.fetch(entry, path, self.make_room(entry, path))
        except OSError as error:
            raise UserError(f"store cache {self.settings.cache}: cannot keep {entry.url} there "
                            f"({error.strerror or error}): set IMAGENET_ELASTIC_STORE_CACHE to a node-local folder "
                            "with room") from None
        return path

    def fetch(self, entry: Entry, path: str, partial: str) -> None:
        """The object into `path` by ranged GETs of CHUNK bytes, each retried on its own (a fault costs a chunk, not
        the shard), through the temporary file `partial` renamed when whole: a kill leaves no shard cut short."""
        try:
            with open(partial, "r+b") as out:
                for start in range(0, entry.size, CHUNK):
                    out.write(read_range(entry.url, start, min(entry.size, start + CHUNK), self.settings.timeout))
            os.replace(partial, path)
        finally:
            Path(partial).unlink(missing_ok=True)

    def make_room(self, entry: Entry, path: str) -> str:
        """Unlink the least recently used shards (and killed fetches' files) until `entry` fits under the cap, or 10%
        of the disk free; then reserve its room: its temporary file at full size (sparse), which other fetches count."""
        cap = self.settings.cache_bytes
        with _locked(os.path.join(self.settings.cache, ".evict.lock")):
            files = []  # (path, size, last use) of each file but the locks
            for found in os.scandir(self.settings.cache):
                with contextlib.suppress(FileNotFoundError):  # unlinked since the listing
                    if not found.name.endswith(".lock"):
                        files.append((found.path, found.stat().st_size, found.stat().st_mtime))
            for name, _, _ in files:
                if ".part-" in name:
                    with _locked(name.rsplit(".part-", 1)[0] + ".lock", blocking=False) as free:
                        if free:  # no process of the node fetches it: what a killed fetch left
                            Path(name).unlink(missing_ok=True)
            shards = sorted((used, size, name) for name, size, used in files if ".part-" not in name)
            fetching = sum(size for name, size, _ in files if ".part-" in name and os.path.exists(name))
            if cap is None:  # the reserved files are sparse: the room they will take is not yet gone from the disk
                over = entry.size + fetching - _room(self.settings.cache)
            elif entry.size > cap:
                raise UserError(f"store cache {self.settings.cache}: a shard of {entry.size / 2 ** 20:.6g} MiB exceeds "
                                "IMAGENET_ELASTIC_STORE_CACHE_GB")
            else:
                over = sum(size for _, size, _ in shards) + fetching + entry.size - cap
            for _, size, name in shards:
                if over <= 0:
                    break
                Path(name).unlink(missing_ok=True)
                over -= size
            partial = f"{path}.part-{os.getpid()}"
            with open(partial, "wb") as out:
                out.truncate(entry.size)
            return partial


def short_cache_note(settings: Settings, split_bytes: int, where: str) -> Optional[str]:
    """A start's note when the node's cache cannot hold a split: a shuffled epoch fetches shards again and again."""
    room = settings.cache_bytes
    if room is None:
        try:
            room = _room(settings.cache if os.path.isdir(settings.cache) else
                         os.path.dirname(settings.cache.rstrip("/")) or "/")
        except OSError:
            return None
    if room >= split_bytes:
        return None
    return (f"the store cache {settings.cache} has room for {room / 2 ** 30:.1f} GiB, less than {where} "
            f"({split_bytes / 2 ** 30:.1f} GiB): shards will be fetched again within each epoch; give it room for the "
            "split (IMAGENET_ELASTIC_STORE_CACHE, IMAGENET_ELASTIC_STORE_CACHE_GB)")


def _whole(path: str, size: int) -> bool:
    with contextlib.suppress(OSError):
        return os.stat(path).st_size == size
    return False


def _room(folder: str) -> int:
    """What a file system has free beyond the tenth of it kept free (the cache's room where it has no cap)."""
    disk = shutil.disk_usage(folder)
    return disk.free - disk.total // 10


@contextlib.contextmanager
def _locked(path: str, blocking: bool = True) -> Iterator[bool]:
    """An exclusive flock on `path` (made if absent) for the block: released by the kernel when a holder dies. Not
    `blocking`: yields False at once where a process of the node (in any container) holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)


def cache() -> ShardCache:
    """The node's cache, as the environment's settings say (read at each use: a dictionary lookup or three)."""
    return ShardCache(settings())
