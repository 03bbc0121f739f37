"""Batches from the loader onto the device: copies on a side stream, --decode gpu's two threads (one decodes, one
crops and augments), the steps' groups of micro-batches, and the time the loop waited for them."""

from __future__ import annotations

import contextlib
import inspect
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from imagenet_elastic.data.device import jpeg_decoders, streams
from imagenet_elastic.data.device.gpu_decode import BatchDecoder
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.errors import one_line


def device_batches(batches: Iterable[Batch], device: torch.device, decoder: Optional[BatchDecoder] = None,
                   out_of_memory: Optional[OutOfMemoryPolicy] = None) -> Iterator[Batch]:
    """The loader's batches with images and labels on `device` (decoded and augmented there first under --decode gpu).
    On CUDA the next batch's copy or decoding overlaps the current step, whose stream waits for it only when it gets
    there; indices stay on the host. A decode out of device memory is told to `out_of_memory` in this thread."""
    if decoder is not None and reads_in_this_thread(batches):
        yield from (prepared(decoder, batch, out_of_memory, device) for batch in batches)
    elif decoder is not None:
        for staged, ready in decoded_in_two_threads(batches, decoder, device, out_of_memory):
            take_on_current_stream(staged, ready, device)
            yield staged
    elif device.type != "cuda":
        yield from (batch.to(device) for batch in batches)
    else:
        side, ahead = streams.feeding_stream(device), None
        for batch in batches:
            with torch.cuda.stream(side):
                staged = batch.to(device)
            if ahead is not None:
                yield ahead
            take_on_current_stream(staged, side.record_event(), device)  # once the previous batch's work is queued
            ahead = staged
        if ahead is not None:
            yield ahead


def decoded_in_two_threads(batches: Iterable[Batch], decoder: BatchDecoder, device: torch.device,
                           out_of_memory: Optional[OutOfMemoryPolicy] = None
                           ) -> Iterator[tuple[Batch, Optional[torch.cuda.Event]]]:
    """`(batch, ready)` for each loader batch, decoded by one thread (decoding stream) while another queues the
    previous batch's crops, policy and erasing (feeding stream): the JPEG libraries hold their calling thread for a
    whole batch. Two chained `decoded_ahead`s: the first alone reads the loader, the errors and out-of-memory notices
    of both reach the taker in order, and closing one closes both."""
    decoding = streams.decoding_stream(device) if streams.on_cuda(device) else None
    decoded = decoded_ahead(batches, decoder.decoded, device, ahead=1, stream=decoding,
                            out_of_memory=pass_on if out_of_memory is not None else None)
    return decoded_ahead(decoded, after_event(decoder.finished, device), device, out_of_memory=out_of_memory)


def after_event(prepare: Callable[[Any], Any], device: torch.device) -> Callable[[tuple[Any, Any]], Any]:
    """`prepare` of a `decoded_ahead`'s `(staged, ready)`, queued after the stream waits (on device) for `ready`."""
    def run(item: tuple[Any, Any]) -> Any:
        staged, ready = item
        if ready is not None:
            torch.cuda.current_stream(device).wait_event(ready)
        return prepare(staged)

    return run


def reads_in_this_thread(batches: Iterable[Batch]) -> bool:
    """A loader without workers draws each sample in the iterating thread, and --decode gpu's policy draws seed torch's
    global generator, which the training thread uses too: such a loader is decoded in the training thread."""
    return isinstance(batches, DataLoader) and batches.num_workers == 0


def take_on_current_stream(staged: Batch, ready: Optional[torch.cuda.Event], device: torch.device) -> None:
    """The current stream waits for `ready`, and `staged`'s tensors are not reused before it is done with them."""
    if ready is None:
        return
    main = torch.cuda.current_stream(device)
    main.wait_event(ready)
    for tensor in (staged.images, staged.labels):
        tensor.record_stream(main)


_DONE = object()


def decoded_ahead(batches: Iterable, prepare: Callable[[Any], Any], device: torch.device, ahead: int = 2,
                  stream: Optional[torch.cuda.Stream] = None, out_of_memory: Optional[OutOfMemoryPolicy] = None
                  ) -> Iterator[tuple[Any, Optional[torch.cuda.Event]]]:
    """`(prepare(batch), ready)` for each batch, by a thread of its own up to `ahead` batches early, on CUDA on
    `stream` (default: the feeding stream), whose event `ready` the taker waits for. Its errors are raised here, in
    order; closing this generator joins the thread, so the loader is never read by two threads. A batch out of device
    memory is told to `out_of_memory` here (`pass_on`: handed on), then the preparing thread prepares it again."""
    results, stop = queue.Queue(maxsize=ahead), threading.Event()
    if streams.on_cuda(device) and stream is None:
        stream = streams.feeding_stream(device)

    def hand_over(item: Any) -> None:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                results.put(item, timeout=0.1)
                return

    def ask(batch: Any, line: str, again: bool) -> bool:
        met = OutOfMemoryMet(batch, line, again)
        hand_over(met)
        while not met.answered.wait(0.1):
            if stop.is_set():
                return False
        return met.go_on

    def work() -> None:
        try:
            with contextlib.ExitStack() as scope:
                if inspect.isgenerator(batches):  # closed last, in the thread that iterated it
                    scope.callback(batches.close)
                if stream is not None:  # the current device and stream are per thread
                    scope.enter_context(torch.cuda.device(device))
                    scope.enter_context(torch.cuda.stream(stream))
                for batch in batches:
                    if isinstance(batch, OutOfMemoryMet):  # an earlier stage's: on to the taker
                        hand_over(batch)
                        if stop.is_set():  # closed before the taker had it: that stage stops too
                            batch.answer(False)
                            return
                        continue
                    staged = prepared(prepare, batch, ask if out_of_memory is not None else None, device)
                    if staged is _STOPPED:
                        break  # _DONE, for a stage that reads this one and waits
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
            if isinstance(item, OutOfMemoryMet) and out_of_memory not in (None, pass_on):
                try:
                    out_of_memory(item.batch, item.line, item.again)  # raises, or prepared again
                except BaseException:
                    item.answer(False)
                    raise
                item.answer(True)
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # it may be waiting for a worker's batch, to hand one over, or for an answer
            with contextlib.suppress(queue.Empty):
                item = results.get(timeout=0.1)
                if isinstance(item, OutOfMemoryMet):
                    item.answer(False)
        thread.join()


OutOfMemoryPolicy = Callable[[Any, str, bool], None]  # (batch, the error's line, failed before): raises to end the run
_STOPPED = object()


def pass_on(batch: Any, line: str, again: bool) -> None:
    """decoded_ahead's marker policy, never called: the notice goes on to whoever reads that decoded_ahead."""


@dataclass
class OutOfMemoryMet:
    """A batch a preparing thread ran out of device memory on, handed to the taking thread in order, which answers
    whether to prepare it again. It holds the error's line: the error's traceback would keep the failed tensors."""

    batch: Any
    line: str
    again: bool  # the same batch ran out of memory before
    answered: threading.Event = field(default_factory=threading.Event, compare=False)
    go_on: bool = True

    def answer(self, go_on: bool) -> None:
        self.go_on = go_on
        self.answered.set()


def prepared(prepare: Callable[[Any], Any], batch: Any,
             out_of_memory: Optional[Callable[[Any, str, bool], Optional[bool]]], device: torch.device) -> Any:
    """`prepare(batch)`; a device out-of-memory error in it goes to `out_of_memory(batch, line, again)` (without it,
    it propagates), then the same batch is prepared again once the allocator returned its cache: no sample lost or
    repeated. `out_of_memory` is an OutOfMemoryPolicy, or decoded_ahead's `ask`: False once its taker stopped."""
    again, owner = False, batch
    while isinstance(owner, tuple):  # the loader's Batch inside what a stage prepares from it: ((batch, images), ready)
        owner = owner[0]
    while True:
        try:
            return prepare(batch)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if out_of_memory is None or not jpeg_decoders.device_out_of_memory(error):
                raise
            line = one_line(error)
        if out_of_memory(owner, line, again) is False:
            return _STOPPED
        if streams.on_cuda(device):
            torch.cuda.empty_cache()
        again = True


class LoaderWaits:
    """Wall time the training loop spent waiting for its next batch on the device; each log line takes it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, batches: Iterable) -> Iterator:
        batches = iter(batches)
        start = time.perf_counter()
        for batch in batches:
            self.seconds += time.perf_counter() - start
            yield batch
            start = time.perf_counter()

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
