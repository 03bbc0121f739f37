"""Rank 0's checkpoint saves: written in the training thread, or in the background from a host copy.

A background save costs the training loop one copy of the state into host memory (pinned buffers on
CUDA, so the device-to-host copies run at full speed); a thread then serializes, writes, fsyncs and
renames while training goes on. The rules that keep "a checkpoint on disk" meaning what it did:

- one save at a time: a new save first waits for the one in flight, so the run holds at most one
  extra copy of the state, in buffers that are reused from save to save;
- whoever needs the file on disk (a preemption stop, the end of the run, an error path) waits for
  the save in flight first (`wait`);
- a process killed mid-write leaves a temp file and the previous `last.pt` (see checkpoint.py);
- a failed write is kept, not raised in the thread: the trainer asks `failed` at each step boundary
  and every rank stops together.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch

from imagenet_elastic.checkpoint import CheckpointManager


class HostCopy:
    """A copy of a (nested) state's tensors in host memory, into the buffers of the previous copy
    when their shape, layout and dtype still fit (the first save allocates them)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffers: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def copy(self, state: Any) -> Any:
        used: dict[tuple, torch.Tensor] = {}

        def walk(value: Any, path: tuple) -> Any:
            if isinstance(value, torch.Tensor):
                buffer = self.buffers.get(path)
                if (buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype
                        or buffer.stride() != value.stride()):
                    buffer = torch.empty_like(value, device="cpu", pin_memory=self.pin)
                used[path] = buffer
                return buffer.copy_(value, non_blocking=self.pin)
            if isinstance(value, dict):
                return {key: walk(item, (*path, key)) for key, item in value.items()}
            if isinstance(value, list):
                return [walk(item, (*path, i)) for i, item in enumerate(value)]
            if isinstance(value, tuple):
                return tuple(walk(item, (*path, i)) for i, item in enumerate(value))
            return value  # numbers and strings are immutable

        copied = walk(state, ())
        if self.pin and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the copies are complete before the writer reads them
        self.buffers = used  # buffers of tensors that went away are freed
        return copied


class CheckpointWriter:
    """Saves through `manager`, one at a time; `background` decides where the write happens."""

    def __init__(self, manager: CheckpointManager, background: bool, device: torch.device) -> None:
        self.manager = manager
        self.background = background
        self.host = HostCopy(pin=device.type == "cuda") if background else None
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[Exception] = None
        self.stall_seconds = 0.0  # what the last save cost its caller
        self.write_seconds = 0.0  # how long the last save took to reach the disk

    def submit(self, state: dict[str, Any], epoch: Optional[int], is_best: bool,
               after: Optional[Callable[[], None]] = None) -> None:
        """Save `state` (see CheckpointManager.save), then run `after` (e.g. metrics.jsonl). Waits for
        the previous save first; after a failed one nothing more is written until it is dealt with."""
        start = time.perf_counter()
        if self.wait() is not None:
            return
        if self.host is None:
            self._write(state, epoch, is_best, after, start)
        else:
            snapshot = self.host.copy(state)
            self.thread = threading.Thread(target=self._write, args=(snapshot, epoch, is_best, after, start),
                                           name="checkpoint-writer", daemon=True)
            self.thread.start()
        self.stall_seconds = time.perf_counter() - start

    def _write(self, state: dict[str, Any], epoch: Optional[int], is_best: bool,
               after: Optional[Callable[[], None]], start: float) -> None:
        try:
            self.manager.save(state, epoch, is_best)
            if after is not None:
                after()
        except Exception as error:  # kept for the training thread: see `failed`
            self.error = error
        self.write_seconds = time.perf_counter() - start

    @property
    def failed(self) -> bool:
        """Whether a save has failed; never waits (asked at every step)."""
        return self.error is not None

    def wait(self) -> Optional[Exception]:
        """Until the save in flight is on disk (or has failed); returns the failure, if any."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return self.error

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
