"""When checkpoints are saved (`Checkpointer`: all ranks agree at a step boundary), and how rank 0 writes them
(`CheckpointWriter`: in the training thread, or in the background, costing the loop a copy into (pinned) host memory).
One save at a time; whoever needs the file on disk waits (`settle`, `close`); a failed write is kept, not raised in
the thread, and all ranks stop at the next step boundary."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import torch

from imagenet_elastic.checkpoint.store import CheckpointFolder, map_tree
from imagenet_elastic.config import Config
from imagenet_elastic.errors import STORAGE_ERROR_EXIT, FailedOnRank0, StorageError, one_line
from imagenet_elastic.launch import distributed


class HostCopy:
    """A host copy of a nested state's tensors in the previous copy's buffers where they fit. From a GPU the copies
    queue on the training stream between the step that made the state and the next, and `copy` returns at once: the
    writer thread waits for them (`wait_copied`), training never does."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.copied: Optional[torch.cuda.Event] = None  # recorded after the last copy's device-to-host copies

    @torch.no_grad()
    def copy(self, state: Any) -> Any:
        used: dict[tuple, torch.Tensor] = {}

        def copy(value: torch.Tensor, path: tuple) -> torch.Tensor:
            buffer = self.buffers.get(path)
            if (buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype
                    or buffer.stride() != value.stride()):
                buffer = torch.empty_like(value, device="cpu", pin_memory=self.pin)
            used[path] = buffer
            return buffer.copy_(value, non_blocking=self.pin)

        copied = map_tree(copy, state)
        self.copied = torch.cuda.current_stream().record_event() if self.pin and torch.cuda.is_available() else None
        self.buffers = used  # buffers of tensors that went away are freed
        return copied

    def wait_copied(self) -> None:
        """Until the last copy is complete in host memory."""
        if self.copied is not None:
            self.copied.synchronize()


class CheckpointWriter:
    """Saves through `files`, one at a time; `background` decides where the write happens."""

    def __init__(self, files: CheckpointFolder, background: bool, device: torch.device) -> None:
        self.files = files
        self.background = background
        self.host = HostCopy(pin=device.type == "cuda") if background else None
        self.thread: Optional[threading.Thread] = None
        self.written = threading.Event()  # set once the thread's write (and its `after`) ended
        self.error: Optional[Exception] = None
        self.stall_seconds = 0.0  # what the last save cost its caller
        self.write_seconds = 0.0  # how long the last save took to reach the disk
        self.on_disk: Optional[tuple[int, int, int]] = None  # the last save written: its step, epochs, samples

    def submit(self, state: dict[str, Any], epoch: Optional[int], is_best: bool,
               after: Optional[Callable[[], None]] = None) -> None:
        """Save `state`, then run `after`, once the previous save is done; nothing after a failed one."""
        start = time.perf_counter()
        if self.wait() is not None:
            return
        if self.host is None:
            self._write(state, epoch, is_best, after, start)
        else:
            thread = threading.Thread(target=self._write, args=(self.host.copy(state), epoch, is_best, after, start),
                                      name="checkpoint-writer", daemon=True)
            with ctrl_c_held():  # a Ctrl-C comes once the thread is started and known, or it could not be awaited
                self.written.clear()
                thread.start()
                self.thread = thread
        self.stall_seconds = time.perf_counter() - start

    def _write(self, state: dict[str, Any], epoch: Optional[int], is_best: bool,
               after: Optional[Callable[[], None]], start: float) -> None:
        try:
            if self.host is not None:
                self.host.wait_copied()  # the host copy's bytes have landed
            self.files.save(state, epoch, is_best)
            self.on_disk = (state.get("step", 0), state.get("epoch", 0),
                            state.get("epoch_progress", {}).get("samples", 0))
            if after is not None:
                after()
        except Exception as error:  # kept for the training thread: see `failed`
            self.error = error
        finally:
            self.write_seconds = time.perf_counter() - start
            self.written.set()

    @property
    def failed(self) -> bool:
        """Whether a save has failed; never waits (asked at every step)."""
        return self.error is not None

    @property
    def writing(self) -> bool:
        """Whether a background write is in flight."""
        return self.thread is not None and not self.written.is_set()

    def wait(self) -> Optional[Exception]:
        """Until the save in flight is on disk (or has failed); returns the failure, if any. A Ctrl-C here leaves the
        write going and the wait repeatable: it waits on `written`, as a Thread.join that a Ctrl-C interrupted takes
        the thread for ended while it still writes (CPython before 3.13, gh-90882)."""
        if self.thread is not None:
            self.written.wait()
            self.thread.join()  # ending: the write is done
            self.thread = None
        return self.error

    def abandon(self) -> bool:
        """Whether a write was in flight, which nothing waits for from now on: a Ctrl-C stopped the wait at once."""
        writing, self.thread = self.writing, None
        return writing

    def take_error(self) -> Exception:
        """The failure, handed over once to be raised."""
        error, self.error = self.error, None
        assert error is not None
        return error

    def close(self) -> Optional[Exception]:
        """Wait for the save in flight and free the host copy; returns a failure nobody took."""
        error = self.wait()
        self.host = None
        return error


class Checkpointer:
    """Every rank's view of checkpointing: when a save is due, and waiting for rank 0's writes."""

    def __init__(self, files: CheckpointFolder, config: Config, device: torch.device, is_main: bool) -> None:
        self.files = files
        self.writer = CheckpointWriter(files, config.async_checkpoint, device)
        self.every_steps, self.every_seconds = config.checkpoint_interval
        self.is_main = is_main
        self.last_save = time.monotonic()

    def at_step_end(self, step: int, stop_requested: bool) -> tuple[bool, bool]:
        """(stop, save) as all ranks agree at this boundary (one gloo all-reduce); a failed write ends every rank."""
        timely = bool(self.every_seconds) and time.monotonic() - self.last_save >= self.every_seconds
        stop, timely, failed = distributed.agree([stop_requested, timely, self.is_main and self.writer.failed])
        if failed:
            self.raise_failure()
        return stop, stop or timely or (bool(self.every_steps) and step % self.every_steps == 0)

    def save(self, capture: Callable[[], dict[str, Any]], epoch: Optional[int], is_best: bool = False,
             then: Sequence[Callable[[], None]] = ()) -> None:
        """Rank 0 hands `capture()` to its writer, `then` its writes to follow it onto the disk, in order (metrics,
        config.yaml, compile cache); `epoch` makes it an epoch's checkpoint. Only a synchronous save is awaited here."""
        if self.is_main:
            self.writer.submit(capture(), epoch, is_best, functools.partial(run_each, list(then)))
        if not self.writer.background:
            self.settle()
        self.last_save = time.monotonic()

    def settle(self) -> None:
        """All ranks wait for rank 0's checkpoint on disk, or stop (exit 74): a run never outruns its checkpoint."""
        failed = self.is_main and self.writer.wait() is not None
        if distributed.agree([failed])[0]:
            self.raise_failure()

    def raise_failure(self) -> None:
        """Every rank raises the writer's error: rank 0 its own (one line for a storage error, a traceback for a
        bug), the others the same line, sent by rank 0, so each names the real culprit."""
        error = self.writer.take_error() if self.is_main else None
        line = distributed.broadcast_object(one_line(error) if error is not None else None, src=0)
        if error is not None:
            raise error
        raise FailedOnRank0(line or "rank 0 could not write a checkpoint", STORAGE_ERROR_EXIT)

    def remove_stale_temp_files(self, warn: Callable[[str], None]) -> None:
        """Rank 0, holding the lock, removes what interrupted writes left, or raises StorageError."""
        for path in self.files.stale_temp_files():
            warn(f"removing {path}, left by a write that was interrupted")
            try:
                os.unlink(path)
            except OSError as error:
                raise StorageError(f"cannot remove {path}, left by an interrupted write in the checkpoints folder: "
                                   f"{error.strerror or error}; remove it by hand") from None


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """A Ctrl-C (SIGINT) during the block comes at its end; threads started in it never take one."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def run_each(steps: list[Callable[[], None]]) -> None:
    for step in steps:
        step()
