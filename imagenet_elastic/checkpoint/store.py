"""Checkpoint files and the folder's lock. A save serializes the state once into a new file committed atomically as
`last.pt`; `epoch_NNNN.pt` and `best.pt` are hard links to it. Each commit renames a new file over a name, so names
sharing a file never change under each other. Only plain data inside: `torch.load(weights_only=True)` opens them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import glob
import os
import re
import secrets
import shlex
import shutil
import socket
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, BinaryIO, Callable, Optional

import torch

from imagenet_elastic.atomic_files import TEMP_PREFIX, commit, storage_error, write_temp
from imagenet_elastic.config import LAST_FILE, RESUME_AUTO, no_checkpoint
from imagenet_elastic.errors import UserError

LOCK = ".lock"
LOCK_LINE_MAX = 200  # `pid P on HOST run TOKEN`
BEST = "best.pt"
EPOCH_PATTERN = re.compile(r"^epoch_(\d{4,})\.pt$")
# What file systems that have no hard links answer (FAT/exFAT, some FUSE and SMB mounts), and "too many links".
LINK_REFUSED = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS, errno.EXDEV}


def save_to(state: dict[str, Any], file: BinaryIO) -> None:
    """Serialize `state` straight into an open file: no second copy of it in memory. torch.save's writer turns a
    failed write into `RuntimeError: ... unexpected pos`: the OSError (its errno says no space, I/O error or quota)
    is raised instead."""
    failed: list[OSError] = []

    def write(data: bytes) -> int:
        try:
            return file.write(data)
        except OSError as error:
            failed.append(error)
            raise

    try:
        torch.save(state, SimpleNamespace(write=write, flush=file.flush))
    except Exception:
        if failed:
            raise failed[0] from None
        raise


def map_tree(fn: Callable[[Any, tuple], Any], tree: Any, leaf: type = torch.Tensor, path: tuple = ()) -> Any:
    """A state's nested dicts, lists and tuples with each `leaf` replaced by `fn(leaf, its keys and indices)`."""
    if isinstance(tree, leaf):
        return fn(tree, path)
    if isinstance(tree, dict):
        return {key: map_tree(fn, item, leaf, (*path, key)) for key, item in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tree(fn, item, leaf, (*path, i)) for i, item in enumerate(tree))
    return tree  # numbers and strings


def state_bytes(state: dict[str, Any]) -> int:
    """About what a save writes: the tensors' bytes (the rest is a few KB of structure)."""
    sizes: list[int] = []
    map_tree(lambda tensor, _: sizes.append(tensor.numel() * tensor.element_size()), state)
    return sum(sizes)


def damage(path: str) -> Optional[str]:
    """Why `path` cannot be a checkpoint, from its zip directory alone (torch.save writes a zip archive whose directory
    ends the file: a file cut short has none), read in milliseconds whatever its size; None where it may be one."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        return "the file is empty" if os.path.getsize(path) == 0 else \
            "not the zip archive torch.save writes (cut short, or another kind of file)"
    if not any(name.endswith("/data.pkl") for name in names):
        return "a zip archive torch.save did not write"
    return None


def unreadable(path: str) -> Optional[str]:
    """Why `path` cannot serve as a checkpoint (missing, unreadable or `damage`), without loading it; None if it may."""
    try:
        return damage(path) if os.path.isfile(path) else "it does not exist"
    except OSError as error:
        return error.strerror or str(error)


def load(path: str, lazy: bool = False) -> dict[str, Any]:
    """Load a checkpoint on CPU; every failure is one line naming the file. `lazy`: map it, reading a tensor's bytes
    only if used (share.py: ranks other than 0 use none)."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist")
    try:
        why = damage(path)
        state = None if why else torch.load(path, map_location="cpu", weights_only=True, mmap=lazy)
    except OSError as error:
        raise UserError(f"checkpoint {path} cannot be read: {error.strerror or error}") from None
    except Exception:  # torch's reader, fed damaged bytes, fails any way they lead it (KeyError: 101, EOFError, ...)
        why = "its content cannot be read back"
    if why:
        raise UserError(f"checkpoint {path} is damaged or not a checkpoint: {why}")
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise UserError(f"checkpoint {path} is not an imagenet_elastic checkpoint")
    return state


def resume_file(resume: str) -> str:
    """The checkpoint `--resume PATH` names: PATH, or PATH/last.pt where PATH is a folder (a run's checkpoints)."""
    return os.path.join(resume, LAST_FILE) if os.path.isdir(resume) else resume


def check_writable(folder: str, names: Sequence[str] = ()) -> None:
    """Fail at start, not after the first epoch, when checkpoints cannot be written: the folder takes no new file, or
    a folder stands where a save renames a file (last.pt, best.pt, epoch_NNNN.pt and `names`, the files that follow
    a checkpoint)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(prefix=TEMP_PREFIX, dir=folder):
            pass
        epochs = [name for name in os.listdir(folder) if EPOCH_PATTERN.match(name)]
    except OSError as error:
        raise UserError(f"checkpoints path {folder} is not writable: {error.strerror or error}") from None
    for path in (os.path.join(folder, name) for name in (LAST_FILE, BEST, *names, *epochs)):
        if os.path.isdir(path) and not os.path.islink(path):
            raise UserError(f"checkpoints path {folder}: {path} is a folder, where the run writes a file: remove or "
                            "rename it")


_HELD_LOCKS: set[int] = set()  # the descriptors of the CheckpointLocks this process holds


def _drop_locks_in_child() -> None:
    """A forked child (a loader worker) closes its copies of the held locks' descriptors: a flock belongs to the open
    file, and a worker outlives a `kill -9` of its process by seconds, in which a `--resume` would find it locked."""
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_locks_in_child)


class CheckpointLock:
    """One writer per checkpoints folder: rank 0 holds an exclusive `flock` on FOLDER/.lock, which the kernel drops
    however it dies. A second run (or an elastic round's leftover rank 0) is waited for, then refused, rather than
    mixing checkpoints or deleting our temp files."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK)
        self.fd: Optional[int] = None

    def acquire(self, wait_s: float, on_wait: Callable[[str], None]) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # open() applies the umask itself
        except OSError as error:  # e.g. a folder of that name
            raise UserError(f"checkpoints path {os.path.dirname(self.path)}: cannot open its lock file {self.path} "
                            f"({error.strerror or error})") from None
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                late = time.monotonic() >= deadline
                holder = parse_lock(os.pread(fd, LOCK_LINE_MAX, 0))[0]
                holder += holders_beyond(holder, fd) if late or not told else ""
                if late:
                    os.close(fd)
                    raise UserError(f"checkpoints path {os.path.dirname(self.path)} is in use by another run "
                                    f"({holder}); wait for it to end or choose another --checkpoints-path") from None
                if not told:
                    on_wait(holder)
                told = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} run {secrets.token_hex(8)}\n".encode(), 0)
        os.fsync(fd)  # on NFS, other nodes see the token only once it reached the server
        self.fd = fd
        _HELD_LOCKS.add(fd)

    def release(self) -> None:
        if self.fd is not None:
            _HELD_LOCKS.discard(self.fd)
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None


def holders_beyond(holder: str, fd: int) -> str:
    """For the message, where the lock's holder (`pid P on HOST`) is an ended process of this host: who still has
    the lock file open (its children, a user's fork), and what to do; "" otherwise."""
    words = holder.split()
    if len(words) != 4 or words[0] != "pid" or not words[1].isdigit() or words[3] != socket.gethostname() \
            or os.path.exists(f"/proc/{words[1]}") or not os.path.isdir("/proc"):
        return ""
    lock, others = os.fstat(fd), []
    for pid in [name for name in os.listdir("/proc") if name.isdigit() and int(name) != os.getpid()]:
        with contextlib.suppress(OSError):
            for entry in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.path.samestat(os.stat(entry.path), lock):
                        others.append(pid)
                        break
    if not others:
        return ", which has ended"
    return (f", which has ended, but pid {', '.join(others)} still hold the lock (processes it started, which end on "
            f"their own within seconds; or end them: kill {' '.join(others)})")


def parse_lock(line: bytes) -> tuple[str, Optional[str]]:
    """The lock file's `pid P on HOST run TOKEN`: who holds it (for messages) and its run's token."""
    holder, _, token = line.decode(errors="replace").strip().partition(" run ")
    return holder.strip() or "unknown process", token.strip() or None


def read_lock_token(folder: str) -> Optional[str]:
    """FOLDER's lock token as seen here: ranks compare it with rank 0's to prove they share the folder."""
    try:
        with open(os.path.join(folder, LOCK), "rb") as f:
            return parse_lock(f.read(LOCK_LINE_MAX))[1]
    except OSError:
        return None


@dataclass
class CheckpointFolder:
    """Owns one checkpoints folder (rank 0 only): `last.pt`, `best.pt`, the newest K `epoch_NNNN.pt`."""

    folder: str
    keep: int
    warn: Callable[[str], None] = print
    links: bool = True  # until the file system refuses one

    @property
    def last_path(self) -> str:
        return os.path.join(self.folder, LAST_FILE)

    def save(self, state: dict[str, Any], epoch: Optional[int] = None, is_best: bool = False) -> None:
        """One write, committed as `last.pt` last after `epoch` (just completed) and `is_best` add `epoch_NNNN.pt` and
        `best.pt` as links. A refused write is a StorageError naming the file, leaving committed files as they were."""
        also = [os.path.join(self.folder, f"epoch_{epoch:04d}.pt")] if self.keep > 0 and epoch is not None else []
        also += [os.path.join(self.folder, BEST)] if is_best else []
        doing, path = "writing", (also or [self.last_path])[0]
        try:
            temp = write_temp(self.folder, LAST_FILE, functools.partial(save_to, state))
            try:
                for path in also:
                    doing = "linking" if self.links else "copying to"
                    self.add_name(temp, path)
                doing, path = "renaming over", self.last_path
                commit(temp, self.last_path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)  # gone once committed; here when an error came first
            doing, path = "removing old checkpoints in", self.folder
            for old in self.epoch_files()[:-self.keep] if self.keep > 0 else self.epoch_files():
                os.unlink(old)
        except OSError as error:
            previous = (f"; the previous checkpoint {self.last_path} is intact" if os.path.isfile(self.last_path)
                        else "")
            raise storage_error(error, doing, path, state_bytes(state) if doing == "writing" else None,
                                previous) from None

    def add_name(self, committed: str, path: str) -> None:
        """`path` atomically becomes a hard link to `committed` (a copy where the file system has no links)."""
        temp = os.path.join(self.folder, f"{TEMP_PREFIX}{os.path.basename(path)}-{secrets.token_hex(4)}")
        try:
            if self.links:
                try:
                    os.link(committed, temp)
                except OSError as error:
                    if error.errno not in LINK_REFUSED:
                        raise
                    self.links = False
                    self.warn(f"{self.folder} does not allow hard links ({error.strerror}): epoch_NNNN.pt and "
                              "best.pt are written as copies of last.pt from now on (one more write each)")
            if not self.links:
                with open(committed, "rb") as source, open(temp, "wb") as copy:
                    shutil.copyfileobj(source, copy, 16 << 20)
                    copy.flush()
                    os.fsync(copy.fileno())
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise

    def check_best(self) -> None:
        """At resume: a damaged best.pt is said, by its zip directory (not loaded: it may be large); the run's next
        best epoch replaces it."""
        path = os.path.join(self.folder, BEST)
        why = unreadable(path) if os.path.lexists(path) else None
        if why:
            self.warn(f"{path} is damaged or not a checkpoint: {why}; the next epoch that beats the run's best val "
                      "top-1 writes it anew")

    def readable(self, names: Sequence[str]) -> Optional[str]:
        """The first of the folder's files `names` that its zip directory shows a checkpoint (none is loaded)."""
        return next((path for path in (os.path.join(self.folder, n) for n in names) if not unreadable(path)), None)

    def epoch_files(self) -> list[str]:
        """Oldest first, by epoch number (a name sort would put epoch_10000 before epoch_9999)."""
        found = sorted((int(m.group(1)), n) for n in os.listdir(self.folder) if (m := EPOCH_PATTERN.match(n)))
        return [os.path.join(self.folder, n) for _, n in found]

    def stale_temp_files(self) -> list[str]:
        return glob.glob(os.path.join(self.folder, f"{TEMP_PREFIX}*"))

    def check_same_run(self, path: str, run: Optional[str]) -> bool:
        """Whether the run resumed from `path` (its `run_id`: `run`) goes on as itself here: False for a fork into a
        folder without last.pt. Overwriting another run's checkpoints is refused, whether `path` lies elsewhere or was
        copied into this folder (a checkpoint of this run's own may roll it back); where either side cannot tell its
        run, a warning."""
        if not os.path.isfile(self.last_path):
            return os.path.samefile(os.path.dirname(path) or ".", self.folder)  # its own checkpoint continues it
        if os.path.realpath(path) == os.path.realpath(self.last_path):
            return True
        try:
            here = load(self.last_path, lazy=True).get("run_id")
        except UserError as error:  # damaged: a backup elsewhere is how such a run goes on
            self.warn(f"{error}: continuing from --resume {path}, whose checkpoints will replace it")
            return True
        if run is None or here is None:
            self.warn(f"cannot tell whether {self.last_path} and --resume {path} are of one run (written before "
                      "checkpoints named their run): continuing over the folder's checkpoints")
            return True
        if here != run:
            raise UserError(f"--checkpoints-path {self.folder} holds another run's checkpoints than --resume {path}: "
                            f"continuing there would overwrite them: --resume {shlex.quote(self.folder)} continues "
                            "them, or choose another --checkpoints-path")
        return True

    def resume_path(self, resume: Optional[str], restarted: bool) -> Optional[str]:
        """The checkpoint this run starts from, or None: a torchrun restart's is `last.pt` wherever it exists (never
        starting over); else `resume` decides: None, RESUME_AUTO or a path."""
        if restarted and os.path.isfile(self.last_path):
            return self.last_path
        if resume not in (None, RESUME_AUTO):
            path = resume_file(resume)
            if not os.path.isfile(path):
                raise UserError(f"--resume {resume}: {no_checkpoint(resume)}")
            return path
        if os.path.exists(self.last_path):
            if resume == RESUME_AUTO:
                return self.last_path
            raise UserError(f"{self.last_path} exists from an earlier run: pass --resume to continue it, "
                            "or choose another --checkpoints-path")
        epochs = self.epoch_files() if os.path.isdir(self.folder) else []
        best = os.path.join(self.folder, BEST)
        newest = epochs[-1] if epochs else (best if os.path.isfile(best) else None)
        if newest is not None:  # last.pt removed (damaged?): starting over would overwrite them without a word
            raise UserError(f"{self.folder} holds an earlier run's checkpoints but no {LAST_FILE}: --resume "
                            f"{shlex.quote(newest)} continues from the newest, or choose another --checkpoints-path")
        return None
