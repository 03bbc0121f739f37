"""Files that are complete or absent: written to a unique temp name in the same folder, flushed and
fsynced, then renamed over their target, and the folder fsynced."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import BinaryIO, Callable, Optional

from imagenet_elastic.errors import StorageError

TEMP_PREFIX = ".tmp-"  # what an interrupted write leaves; the checkpoints folder's owner removes it at start


def process_umask() -> int:
    """The umask, from /proc on Linux: setting and restoring it would briefly change it for every thread."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def nearest_existing(path: str) -> str:
    """The deepest part of `path` that exists (a dangling link counts): the folder a makedirs of `path` would write
    in, which a check before any write holds against being a folder."""
    path = os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def storage_error(error: OSError, doing: str, path: str, size: Optional[int] = None, after: str = "") -> StorageError:
    """`no space left on device writing /ckpt/epoch_0002.pt (205 MB)`: the OS's words, then what and where."""
    text = error.strerror or str(error) or type(error).__name__
    amount = "" if not size else f" ({size / 1e6:.0f} MB)" if size >= 1e6 else f" ({size / 1e3:.0f} kB)"
    return StorageError(f"{text[:1].lower()}{text[1:]} {doing} {os.path.abspath(path)}{amount}{after}")


def write_temp(folder: str, name: str, write: Callable[[BinaryIO], None]) -> str:
    """A new fsynced temp file beside `name`, filled by `write`, for the caller to rename; removed on any failure."""
    fd, temp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{name}-", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~process_umask())  # mkstemp's 0600 would hide checkpoints from the rest of a team
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    return temp


def commit(temp: str, path: str) -> None:
    """Rename a finished temp file over `path` and make the rename durable."""
    try:
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(data: bytes, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    commit(write_temp(folder, os.path.basename(path), lambda f: f.write(data)), path)


def store_bytes(data: bytes, path: str) -> None:
    """atomic_write_bytes for a file of the run's record: the OS's refusal is a StorageError (see storage_error)."""
    try:
        atomic_write_bytes(data, path)
    except OSError as error:
        raise storage_error(error, "writing", path) from None
