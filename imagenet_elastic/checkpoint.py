"""Checkpoint files: atomic writes, safe loads, and the last/best/epoch_NNNN layout.

A file is written to a unique temp name in the same folder, flushed and fsynced, then renamed over
its target: readers see the old file or the new one, never a partial one. Checkpoints hold plain
tensors, numbers, strings, lists and dicts only, so `torch.load(weights_only=True)` opens them.
"""

from __future__ import annotations

import fcntl
import glob
import io
import os
import re
import socket
import tempfile
import time
from typing import Any, Callable, Optional

import torch

from imagenet_elastic.errors import UserError

LAST = "last.pt"
LOCK = ".lock"
BEST = "best.pt"
EPOCH_PATTERN = re.compile(r"^epoch_(\d{4,})\.pt$")
TEMP_PREFIX = ".tmp-"
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_bytes(data: bytes, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{os.path.basename(path)}-", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide checkpoints from the rest of a team
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    """Make a rename durable (the directory entry itself must reach the disk)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def serialize(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def load(path: str) -> dict[str, Any]:
    """Load a checkpoint on CPU; every failure becomes one line naming the file."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, pickle errors, EOFError, zipfile errors...
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"checkpoint {path} is damaged or not a checkpoint ({first[:200]})") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise UserError(f"checkpoint {path} is not an imagenet_elastic checkpoint")
    return state


def check_writable(folder: str) -> None:
    """Fail at start, not after the first epoch, when checkpoints cannot be written."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(prefix=TEMP_PREFIX, dir=folder):
            pass
    except OSError as error:
        raise UserError(f"checkpoints path {folder} is not writable: {error.strerror or error}") from None


class CheckpointLock:
    """One writer per checkpoints folder: rank 0 holds an exclusive `flock` on FOLDER/.lock while it runs.

    A second run started against the same folder (or a leftover rank 0 of an elastic round that has
    not died yet) is waited for, then refused, instead of interleaving its checkpoints with ours or
    deleting our temp files as stale. The kernel drops the lock when its holder dies, however it dies.
    """

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK)
        self.fd: Optional[int] = None

    def acquire(self, wait_s: float, on_wait: Callable[[str], None]) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~_UMASK)
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise UserError(f"checkpoints path {os.path.dirname(self.path)} is in use by another run "
                                    f"({holder}); wait for it to end or choose another --checkpoints-path") from None
                if not told:
                    on_wait(holder)
                    told = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None


class CheckpointManager:
    """Owns one checkpoints folder: `last.pt`, `best.pt` and the newest K `epoch_NNNN.pt`.

    Only rank 0 calls `save`. A round is complete once `last.pt` names it; older epoch files are
    removed only after that.
    """

    def __init__(self, folder: str, keep: int) -> None:
        self.folder = folder
        self.keep = keep

    @property
    def last_path(self) -> str:
        return os.path.join(self.folder, LAST)

    def epoch_path(self, epoch: int) -> str:
        return os.path.join(self.folder, f"epoch_{epoch:04d}.pt")

    def save(self, state: dict[str, Any], epoch: Optional[int] = None, is_best: bool = False) -> None:
        """`epoch`: the epoch just completed, which also gets its own file; None for a mid-epoch save."""
        data = serialize(state)
        if self.keep > 0 and epoch is not None:
            atomic_write_bytes(data, self.epoch_path(epoch))
        atomic_write_bytes(data, self.last_path)
        if is_best:
            atomic_write_bytes(data, os.path.join(self.folder, BEST))
        self.prune()

    def epoch_files(self) -> list[str]:
        """Oldest first, by epoch number (a name sort would put epoch_10000 before epoch_9999)."""
        found = ((m, n) for n in os.listdir(self.folder) if (m := EPOCH_PATTERN.match(n)))
        return [os.path.join(self.folder, n) for m, n in sorted(found, key=lambda mn: int(mn[0].group(1)))]

    def prune(self) -> None:
        for path in self.epoch_files()[:-self.keep] if self.keep > 0 else self.epoch_files():
            os.unlink(path)

    def stale_temp_files(self) -> list[str]:
        return glob.glob(os.path.join(self.folder, f"{TEMP_PREFIX}*"))

    def resume_path(self, resume: Optional[str], restarted: bool) -> Optional[str]:
        """The checkpoint this run starts from, or None for a fresh start.

        A torchrun restart continues from `last.pt` whenever it exists, so a restarted round never
        starts over. Otherwise `resume` decides: None (fresh), "auto" (`last.pt` when it exists) or a
        path, which must exist.
        """
        if restarted and os.path.isfile(self.last_path):
            return self.last_path
        if resume not in (None, "auto"):
            if not os.path.isfile(resume):
                raise UserError(f"--resume {resume}: no such checkpoint file")
            return resume
        if os.path.exists(self.last_path):
            if resume == "auto":
                return self.last_path
            raise UserError(f"{self.last_path} exists from an earlier run: pass --resume to continue it, "
                            "or choose another --checkpoints-path")
        return None
