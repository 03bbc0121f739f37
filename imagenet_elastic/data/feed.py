"""Batches from the loader onto the device: copies on a side stream, --decode gpu's decoding thread, the steps'
groups of micro-batches, and the time the loop waited for them."""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.utils.data import DataLoader

from imagenet_elastic.data import jpeg_decoders
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.errors import one_line

if TYPE_CHECKING:
    from imagenet_elastic.data.gpu_decode import BatchDecoder


def device_batches(batches: Iterable[Batch], device: torch.device, decoder: Optional[BatchDecoder] = None,
                   out_of_memory: Optional[OutOfMemoryPolicy] = None) -> Iterator[Batch]:
    """The loader's batches with images and labels on `device` (decoded and augmented there first under
    --decode gpu).

    Batches travel as uint8, a quarter of the bytes of float32 (or, under --decode gpu, as the files' bytes). On
    CUDA the next batch's copy, or its whole decoding (`decoded_ahead`: a thread of its own, on the feeding
    stream), runs while the current one trains; the training stream waits for it only when it gets there, and
    the training thread does nothing per image. Other entries (sample indices) stay on the host, so reading them
    never waits for the device. A decode that runs out of device memory is told to `out_of_memory` (see
    `prepared`), which ends the run or has the same batch decoded again.
    """
    if decoder is not None:
        if reads_in_this_thread(batches):
            yield from (prepared(decoder, batch, out_of_memory, device) for batch in batches)
            return
        for staged, ready in decoded_ahead(batches, decoder, device, out_of_memory=out_of_memory):
            take_on_current_stream(staged, ready, device)
            yield staged
        return
    if device.type != "cuda":
        yield from (batch.to(device) for batch in batches)
        return
    side, main = feeding_stream(device), torch.cuda.current_stream(device)
    ahead = None
    for batch in batches:
        with torch.cuda.stream(side):
            staged = batch.to(device)
        if ahead is not None:
            yield ahead
        main.wait_stream(side)
        for tensor in (staged.images, staged.labels):
            tensor.record_stream(main)  # allocated on `side`: not reused before `main` is done with it
        ahead = staged
    if ahead is not None:
        yield ahead


def reads_in_this_thread(batches: Iterable[Batch]) -> bool:
    """A loader without workers (--workers 0) reads and draws each sample in the thread that iterates it, and the
    draws of --decode gpu's policy seed torch's global generator (augment.Augment.draws), which the training
    thread seeds and draws from too: such a loader is decoded in the training thread, not beside it."""
    return isinstance(batches, DataLoader) and batches.num_workers == 0


@functools.cache
def feeding_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that copies, decodes and augments batches for `device`: made once per process (not per epoch
    or validation pass), at high priority, so that its short kernels are scheduled ahead of the training
    stream's queue instead of waiting behind a whole forward and backward."""
    return torch.cuda.Stream(device, priority=-1)  # lower is higher; torch maps it into the device's range


def take_on_current_stream(staged: Batch, ready: Optional[torch.cuda.Event], device: torch.device) -> None:
    """The current (training) stream waits for the event that made `staged`'s device tensors on another
    stream, and those tensors are not reused before the current stream is done with them."""
    if ready is None:
        return
    main = torch.cuda.current_stream(device)
    main.wait_event(ready)
    for tensor in (staged.images, staged.labels):
        tensor.record_stream(main)


_DONE = object()


def decoded_ahead(batches: Iterable, prepare: Callable[[Any], Any], device: torch.device, ahead: int = 2,
                  out_of_memory: Optional[OutOfMemoryPolicy] = None
                  ) -> Iterator[tuple[Any, Optional[torch.cuda.Event]]]:
    """`(prepare(batch), ready)` for each batch, run by a thread of its own up to `ahead` batches before they
    are taken; on CUDA on the feeding stream, whose event `ready` the taker waits for (None on a CPU). Its
    errors (a corrupt image) are raised here, in order; closing this generator stops the thread and waits
    for it, so the loader is never read by two threads. A batch that runs out of device memory is told to
    `out_of_memory` here, in order, in the taking thread; the decoding thread waits for its answer, then
    prepares the same batch again (see `prepared`)."""
    results: queue.Queue = queue.Queue(maxsize=ahead)
    stop, answered = threading.Event(), threading.Event()
    stream = feeding_stream(device) if device.type == "cuda" else None

    def hand_over(item: Any) -> None:
        while not stop.is_set():
            try:
                results.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def ask(batch: Any, line: str, again: bool) -> bool:
        """The taking thread's answer to a batch that ran out of memory: False when it stopped instead."""
        hand_over(OutOfMemoryMet(batch, line, again))
        while not answered.wait(0.1):
            if stop.is_set():
                return False
        answered.clear()
        return True

    def work() -> None:
        try:
            with contextlib.ExitStack() as scope:
                if stream is not None:  # the current device and stream are per thread
                    scope.enter_context(torch.cuda.device(device))
                    scope.enter_context(torch.cuda.stream(stream))
                for batch in batches:
                    staged = prepared(prepare, batch, ask if out_of_memory is not None else None, device)
                    if staged is _STOPPED:
                        return
                    hand_over((staged, stream.record_event() if stream is not None else None))
                    if stop.is_set():  # closed: take no further batch from the loader
                        return
            hand_over(_DONE)
        except BaseException as error:  # every failure is the training thread's to raise
            hand_over(error)

    thread = threading.Thread(target=work, name="decode-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item = results.get()
            if item is _DONE:
                return
            if isinstance(item, OutOfMemoryMet):
                out_of_memory(item.batch, item.line, item.again)  # raises, or the same batch is prepared again
                answered.set()
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # it may be waiting for a worker's batch or to hand one over
            with contextlib.suppress(queue.Empty):
                results.get(timeout=0.1)
        thread.join()


OutOfMemoryPolicy = Callable[[Any, str, bool], Optional[bool]]  # (batch, the error's line, whether it failed before)
_STOPPED = object()


@dataclass(frozen=True)
class OutOfMemoryMet:
    """A batch the decoding thread ran out of device memory preparing, handed to the taking thread in order. It holds
    the error's line, not the error: the failed attempt's tensors are freed with its traceback before the retry."""

    batch: Any
    line: str
    again: bool  # the same batch ran out of memory before


def prepared(prepare: Callable[[Any], Any], batch: Any, out_of_memory: Optional[OutOfMemoryPolicy],
             device: torch.device) -> Any:
    """`prepare(batch)`. A device out-of-memory error in it (torch's, or a JPEG decoder's, as
    jpeg_decoders.device_out_of_memory tells them) goes to `out_of_memory(batch, line, again)`, which raises to end
    the run, returns False to stop (`_STOPPED`), or else has the same batch prepared again, once the allocator has
    returned what it caches to the device: no sample lost or repeated. Without `out_of_memory` the error is raised as
    it came."""
    again = False
    while True:
        try:
            return prepare(batch)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if out_of_memory is None or not jpeg_decoders.device_out_of_memory(error):
                raise
            line = one_line(error)
        if out_of_memory(batch, line, again) is False:
            return _STOPPED
        if device.type == "cuda":
            torch.cuda.empty_cache()
        again = True


class LoaderWaits:
    """Wall time the training loop spent waiting for its next batch on the device (from the loader, and
    under --decode gpu from the decoding thread); each log line takes it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, batches: Iterable) -> Iterator:
        batches = iter(batches)
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.seconds += time.perf_counter() - start
            yield batch

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def step_groups(loader: Iterable[Batch], accum: int) -> Iterator[list[Batch]]:
    """The loader's micro-batches, `accum` at a time: one list per optimizer step."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == accum:
            yield group
            group = []
