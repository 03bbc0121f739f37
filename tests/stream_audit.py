"""Recording stand-ins for CUDA's streams and events, so that the feeding and decoding code (data/device/: feed.py,
gpu_decode.py, jpeg_decoders.py) runs on CPU tensors as it runs on CUDA, and the order CUDA would keep
between its threads' and streams' work is checked (tests/data/device/test_stream_audit.py).

The seam: `streams.on_cuda` answers yes for the CPU device, so the code takes its CUDA branches (streams, events,
record_stream, Held) while its tensors stay on the CPU; `torch.cuda.Stream`, `Event`, `current_stream`,
`stream(...)`, `device(...)`, `synchronize` and `Tensor.record_stream` are replaced by the recorders here; and
every thread started meanwhile runs its operators under a dispatch mode that puts each one on its thread's
current stream, as CUDA queues a kernel. Each stream keeps a vector clock (how far into every stream's work its
next operator is ordered); an event snapshots its stream's clock, a wait merges it. The device runs nothing: an
event is complete when the host synchronised it, or (`lag`) once `lag` later events were recorded on its stream.

The rules, each broken by a defect of its kind in the tests:
- finished-before-handover: an operator on one stream reads a tensor another stream wrote only after an event
  recorded there after the write, and waited for: what crosses threads is finished before its ready event.
- recorded-on-training-stream: a tensor used on a stream other than the one it was allocated on, or handed to the
  training thread, was given to `record_stream` for that stream before that use (else torch's allocator may
  reuse its memory while that stream still reads it); the decoder's outputs are the exception, held instead:
- held-until-read: a decoder output is dropped only once the host has seen complete an event recorded after
  every operator that read it (the crops): freed sooner, the next decode could write it while they still read.
- host-wait-blocks: the host waits for the device only through events made with `blocking=True` (a default
  event's or a stream's synchronize spins a core).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from imagenet_elastic.data.device import streams

FINISHED = "finished-before-handover"
RECORDED = "recorded-on-training-stream"
HELD = "held-until-read"
BLOCKS = "host-wait-blocks"


class Stream:
    """A CUDA stream as its order of work: a vector clock over all streams."""

    def __init__(self, audit: StreamAudit, name: str, priority: int = 0) -> None:
        self.audit, self.name, self.priority = audit, name, priority
        self.clock: dict[Stream, int] = {self: 0}
        self.cuda_stream = id(self)
        self.events: list[Event] = []

    def __repr__(self) -> str:
        return self.name

    def tick(self) -> int:
        self.clock[self] += 1
        return self.clock[self]

    def record_event(self, event: Optional[Event] = None) -> Event:
        event = event if event is not None else Event(self.audit)
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        for stream, position in (event.clock or {}).items():  # an event never recorded: nothing to wait for
            self.clock[stream] = max(self.clock.get(stream, 0), position)

    def wait_stream(self, other: Stream) -> None:
        self.wait_event(other.record_event())

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.audit.broken(BLOCKS, f"the host synchronised stream {self} (spins)")
        self.audit.observe(dict(self.clock))


class Event:
    def __init__(self, audit: StreamAudit, blocking: bool = False) -> None:
        self.audit, self.blocking = audit, blocking
        self.clock: Optional[dict[Stream, int]] = None
        self.stream: Optional[Stream] = None
        self.synced = False

    def record(self, stream: Optional[Stream] = None) -> None:
        stream = stream if stream is not None else self.audit.current()
        self.clock, self.stream, self.synced = dict(stream.clock), stream, False
        stream.events.append(self)

    def wait(self, stream: Optional[Stream] = None) -> None:
        (stream if stream is not None else self.audit.current()).wait_event(self)

    def query(self) -> bool:
        if self.clock is None:
            return True
        later = len(self.stream.events) - 1 - self.stream.events.index(self)
        done = self.synced or later >= self.audit.lag
        if done:
            self.audit.observe(self.clock)
        return done

    def synchronize(self) -> None:
        if not self.blocking:
            self.audit.broken(BLOCKS, "the host synchronised an event made without blocking=True (spins)")
        self.synced = True
        if self.clock is not None:
            self.audit.observe(self.clock)


class Memory:
    """What the audit knows of one storage: the stream it was allocated on (None: host memory made outside the
    audit), its last write, the last read on each stream, the streams record_stream named, the tensors over it."""

    def __init__(self, stream: Optional[Stream]) -> None:
        self.stream = stream
        self.write: Optional[tuple[Stream, int]] = None
        self.reads: dict[Stream, int] = {}
        self.recorded: set[Stream] = set()
        self.tensors: dict[int, weakref.ref] = {}
        self.decoder_output = False
        self.delivered_to: Optional[Stream] = None

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.tensors.values())

    def add(self, tensor: torch.Tensor) -> Memory:
        if id(tensor) not in self.tensors or self.tensors[id(tensor)]() is not tensor:
            self.tensors[id(tensor)] = weakref.ref(tensor)
        return self


class StreamAudit:
    """Install with `install(monkeypatch)`; then run the code; `violations` holds (rule, what) pairs."""

    def __init__(self, lag: int = 0) -> None:
        self.lag = lag
        self.violations: list[tuple[str, str]] = []
        self.memory: dict[int, Memory] = {}
        self.observed: list[dict[Stream, int]] = []  # clocks of the events the host saw complete
        self.local = threading.local()
        self.lock = threading.RLock()
        self.closed = False
        self.default = Stream(self, "default")
        self.streams: list[Stream] = [self.default]

    # ------------------------------------------------------------------ what the code under audit calls
    def install(self, monkeypatch: Any) -> None:
        audit = self

        def make_stream(device: Any = None, priority: int = 0, **_: Any) -> Stream:
            stream = Stream(audit, f"stream{len(audit.streams)}(priority {priority})", priority)
            audit.streams.append(stream)
            return stream

        def record_stream(tensor: torch.Tensor, stream: Stream) -> None:
            with audit.lock:
                audit.known(tensor).recorded.add(stream)

        original_run = threading.Thread.run

        def run(thread: threading.Thread) -> None:
            with audit.recording():
                original_run(thread)

        monkeypatch.setattr(streams, "on_cuda", lambda device: True)
        monkeypatch.setattr(torch.cuda, "Stream", make_stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False, blocking=False, interprocess=False:
                            Event(audit, blocking))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: audit.current())
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.default.synchronize())
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
        monkeypatch.setattr(threading.Thread, "run", run)
        streams.feeding_stream.cache_clear()
        streams.decoding_stream.cache_clear()

    def current(self) -> Stream:
        return getattr(self.local, "stream", None) or self.default

    @contextlib.contextmanager
    def stream(self, stream: Optional[Stream]) -> Iterator[None]:
        before = getattr(self.local, "stream", None)
        if stream is not None:
            self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = before

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Operators of the calling thread, put on its current stream."""
        with Recorder(self):
            yield

    # ------------------------------------------------------------------ what the audit test calls
    def track_decoder(self, jpeg: Any) -> None:
        """The JPEG library's outputs are decoder outputs: held-until-read watches when they are dropped."""
        decode = jpeg.decode

        def tracked(data: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
            images = decode(data)
            with self.lock:
                for image in images:
                    if image is not None:
                        memory = self.known(image)
                        memory.decoder_output = True
                        weakref.finalize(image, self.dropped, memory)
            return images

        jpeg.decode = tracked

    def delivered(self, *tensors: torch.Tensor) -> None:
        """`tensors` reached the training thread: their first use on its stream needs record_stream first."""
        with self.lock:
            for tensor in tensors:
                self.known(tensor).delivered_to = self.current()

    def close(self) -> None:
        """What is dropped from now on (the decoder's last held batches, at the end of a run) is not judged."""
        self.closed = True

    def rules_broken(self) -> set[str]:
        return {rule for rule, _ in self.violations}

    # ------------------------------------------------------------------ bookkeeping
    def broken(self, rule: str, what: str) -> None:
        if not self.closed:
            self.violations.append((rule, what))

    def observe(self, clock: dict[Stream, int]) -> None:
        with self.lock:
            self.observed.append(dict(clock))

    def known(self, tensor: torch.Tensor, stream: Optional[Stream] = None, fresh: bool = False) -> Memory:
        """The record of `tensor`'s storage; a new one (allocated on `stream`) when `fresh`, unknown, or all its
        tensors are gone (the address reused)."""
        key = storage_key(tensor)
        memory = self.memory.get(key)
        if fresh or memory is None or not memory.alive():
            memory = self.memory[key] = Memory(stream)
        return memory.add(tensor)

    def operator(self, name: str, reads: list[torch.Tensor], writes: list[torch.Tensor],
                 fresh: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        stream = self.current()
        with self.lock:
            position = stream.tick()
            for tensor in reads:
                memory = self.known(tensor)
                self.check_read(name, stream, memory)
                memory.reads[stream] = position
            for tensor in fresh:
                self.known(tensor, stream, fresh=True).write = (stream, position)
            for tensor in writes:
                self.known(tensor, stream).write = (stream, position)
            for tensor in views:
                self.known(tensor, stream)

    def check_read(self, name: str, stream: Stream, memory: Memory) -> None:
        if memory.write is not None:
            writer, position = memory.write
            if stream.clock.get(writer, 0) < position:
                self.broken(FINISHED, f"{name} on {stream} reads a tensor {writer} wrote, without an event recorded "
                                      f"there after the write and waited for")
        crossing = memory.delivered_to is stream or (memory.stream is not None and memory.stream is not stream)
        if crossing and not memory.decoder_output and stream not in memory.recorded:
            self.broken(RECORDED, f"{name} on {stream} uses a tensor allocated on {memory.stream} without "
                                  f"record_stream({stream}) first")

    def dropped(self, memory: Memory) -> None:
        if self.closed:
            return
        with self.lock:
            for stream, position in memory.reads.items():
                if not any(clock.get(stream, 0) >= position for clock in self.observed):
                    self.broken(HELD, f"a decoder output read on {stream} was dropped before the host saw an "
                                      f"event after that read complete")


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def plain_tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among `values` whose memory the audit can name (not nested or empty ones)."""
    out = []
    for value in tree_flatten(values)[0]:
        if isinstance(value, torch.Tensor) and not value.is_nested and value.device.type == "cpu":
            try:
                if value.untyped_storage().nbytes() > 0:
                    out.append(value)
            except (RuntimeError, NotImplementedError):
                continue
    return out


class Recorder(TorchDispatchMode):
    """Each operator of its thread, with what it read and wrote, as work of that thread's current stream."""

    def __init__(self, audit: StreamAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        schema = func._schema
        inputs = plain_tensors((args, kwargs))
        input_keys = {storage_key(t) for t in inputs}
        mutated = [value for argument, value in zip(schema.arguments, args)
                   if argument.alias_info is not None and argument.alias_info.is_write]
        mutated += [kwargs[argument.name] for argument in schema.arguments
                    if argument.name in kwargs and argument.alias_info is not None and argument.alias_info.is_write]
        outputs = plain_tensors(result)
        is_view = bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                               for r in schema.returns)
        fresh = [t for t in outputs if storage_key(t) not in input_keys]
        self.audit.operator(str(func), reads=[] if is_view else inputs, writes=plain_tensors(mutated),
                            fresh=fresh, views=[t for t in outputs if storage_key(t) in input_keys])
        return result
