"""torch.compile's caches in CHECKPOINTS/compile_cache.bin, since a restart often lands on a node whose own compile
cache (TORCHINDUCTOR_CACHE_DIR, /tmp by default) is empty: rank 0 keeps torch's Mega-Cache there (torch >= 2.7), every
rank loads it before its first compiled call. Only a cache: a missing, unreadable or mismatched file (another
`cache_key`: left unread) costs a cold compile, never the run, and is rewritten once this run has compiled."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from imagenet_elastic.atomic_files import atomic_write_bytes, nearest_existing
from imagenet_elastic.errors import UserError, first_line

FILE_NAME = "compile_cache.bin"
MAGIC = b"imagenet_elastic compile cache 1\n"  # then one line of JSON (key, checksum, artifacts), then torch's blob
# the local cache folders torch and Triton make where these name (torch's at its compiler's import, e.g. by timm's)
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def check_cache_folders(environ: Mapping[str, str]) -> None:
    """A cache variable naming a file (or a path through one) is one line before anything is done: torch would meet
    it with a FileExistsError traceback at the import of its compiler. Nothing is made: a check of the path alone."""
    for name in CACHE_VARIABLES:
        path = nearest_existing(environ.get(name) or ".")
        if not os.path.isdir(path):
            raise UserError(f"{name}={environ[name]}: {path} is not a folder: name a folder for the compile cache, "
                            "or unset it")


def supported() -> bool:
    """Whether this torch has the Mega-Cache (2.7 and later; 2.6 compiles without it)."""
    return hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")


def triton_version() -> Optional[str]:
    """Triton's version, under the names its wheels have (nightly torch installs pytorch-triton); None without it."""
    for name in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def cache_key(device: torch.device, **settings: Any) -> dict[str, Any]:
    """What compiled graphs depend on besides shapes: versions, the device, the caller's code-changing `settings`."""
    name = device.type
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return {"torch": torch.__version__, "triton": triton_version(), "device": name, **settings}


def mismatch(saved: dict[str, Any], mine: dict[str, Any]) -> str:
    """The first difference between two keys, as `torch 2.11.0, now 2.13.0`."""
    return next((f"{name} {saved.get(name)}, now {mine.get(name)}" for name in sorted(set(saved) | set(mine))
                 if saved.get(name) != mine.get(name)), "nothing")


def encode(key: dict[str, Any], blob: bytes, artifacts: Iterable[str]) -> bytes:
    header = {"key": key, "sha256": hashlib.sha256(blob).hexdigest(), "artifacts": sorted(artifacts)}
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + blob


def decode(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and torch's blob; ValueError saying what is wrong with a file that is not one whole."""
    if not data.startswith(MAGIC):
        raise ValueError("not a compile cache of this program")
    line, newline, blob = data[len(MAGIC):].partition(b"\n")
    try:
        header = json.loads(line) if newline else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or not isinstance(header.get("key"), dict) or "sha256" not in header:
        raise ValueError("its header is damaged")
    if hashlib.sha256(blob).hexdigest() != header["sha256"]:
        raise ValueError("its checksum does not match its contents")
    return header, blob


@contextlib.contextmanager
def torch_cache_log() -> Iterator[list[logging.LogRecord]]:
    """What torch's Mega-Cache logs meanwhile (a failed load: a warning with its traceback), kept from the console."""
    logger, records = logging.getLogger("torch.compiler._cache"), []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


@dataclass
class CompileCache:
    """CHECKPOINTS/compile_cache.bin for one run: `load` on every rank before the first compiled call; rank 0
    `collect`s in the training thread (where torch compiles) and `write`s anywhere."""

    folder: str
    key: dict[str, Any]
    warn: Callable[[str], None]
    state: str = "none yet"  # for the start-up table: loaded, none yet, ignored (why), unreadable, unsupported
    loaded: bool = False
    load_seconds: Optional[float] = None  # reading a file that was there, and loading it into torch's caches
    known: frozenset[str] = field(default_factory=frozenset)  # the artifacts the file holds
    failed: bool = False  # a write failed: warned once, not tried again

    @property
    def path(self) -> str:
        return os.path.join(self.folder, FILE_NAME)

    def load(self) -> None:
        """Preloads torch's caches from a file of this key, else says why not; never raises: at worst a cold compile."""
        if not supported():
            self.state = f"unsupported by torch {torch.__version__} (no torch.compiler.save_cache_artifacts)"
            return
        start = time.perf_counter()
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # state: "none yet"
            return
        except OSError as error:
            self.unreadable(error.strerror or first_line(error))
            return
        try:
            header, blob = decode(data)
            if header["key"] != self.key:
                self.state = f"{self.path} ignored: written for {mismatch(header['key'], self.key)}"
            else:
                with torch_cache_log() as records:
                    info = torch.compiler.load_cache_artifacts(blob)
                if info is None:  # torch/compiler/_cache.py: deserialize() logs the error and returns None
                    error = next((r.exc_info[1] for r in records if r.exc_info and r.exc_info[1] is not None), None)
                    why = first_line(error) if error is not None else records[0].getMessage() if records else None
                    raise ValueError("torch could not read it" + (f": {why}" if why is not None else ""))
                self.known = frozenset(header.get("artifacts", ()))
                self.state, self.loaded = f"loaded from {self.path}", True
        except Exception as error:  # a damaged file, or a local cache folder torch cannot write
            self.unreadable(first_line(error))
        self.load_seconds = time.perf_counter() - start

    def unreadable(self, why: str) -> None:
        self.warn(f"ignoring the compile cache {self.path} ({why}): compiling from scratch; rewritten once this run "
                  "has compiled")
        self.state = f"{self.path} unreadable, ignored"

    def collect(self) -> Optional[bytes]:
        """The file's new contents if this process compiled graphs it lacks, else None (cheap: from memory)."""
        if self.failed or not supported():
            return None
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as error:  # only a cache: a torch that cannot serialize its own costs a warning
            self.failed = True
            self.warn(f"could not collect torch's compile caches ({first_line(error)}); a restart will compile "
                      "from scratch")
            return None
        if saved is None:  # nothing compiled through torch's caches (another backend, caches turned off)
            return None
        blob, info = saved
        # torch's CacheInfo as `type:key` names: what the blob holds, to tell whether a newer one holds more
        names = frozenset(f"{kind}:{key}" for kind, keys in getattr(info, "artifacts", {}).items() for key in keys)
        if names <= self.known:  # a warm start: the same graphs came out of the loaded caches
            return None
        self.known = names
        return encode(self.key, blob, names)

    def write(self, data: bytes) -> None:
        """Atomically (readers see old or new); a refused write is one warning, and the run goes on without it."""
        try:
            atomic_write_bytes(data, self.path)
        except OSError as error:
            self.failed = True
            self.warn(f"could not write the compile cache {self.path}: {error.strerror or error}; a restart will "
                      "compile from scratch")
