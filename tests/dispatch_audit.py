"""A dispatch-level audit of the CUDA paths that runs on a CPU (tests/data/device/test_dispatch_audit.py): every
operator a piece of code dispatches is checked for what would make the host wait for the GPU, and those that reach the
device are counted.

How it tells the device from the host: the code runs on fake tensors of device `cuda` (torch's FakeTensorMode:
shapes and strides without data, no GPU needed), so it takes its real CUDA branches (`device.type == "cuda"`:
pinning, streams, CUDA-only kernels' host logic) and a tensor is on the device exactly when a GPU would have it
there, with no guess about which CPU tensor stands for which. What the caller hands in (a loader's batch) is real
host memory. Without CUDA nothing can be pinned, so `Tensor.pin_memory` becomes a stand-in that copies and tags
the copy's storage (its views stay pinned, as a pinned buffer's do), and torch.cuda's streams, events and stream
contexts stand-ins that only record; `torch.cuda.synchronize` and an event's or a stream's `synchronize` are
host waits. No pixel is computed: the pixels' tests run on real CPU tensors.

Each rule fails at the operator that breaks it (AuditFailure, naming it):
- a device value read by the host: `.item()`, `bool()`, `int()`, `.tolist()` (`_local_scalar_dense`),
  `is_nonzero`, `equal`; a copy to the host that is not non_blocking (into pinned memory);
- an operator whose CUDA kernel makes the host wait (SYNCHRONIZING), a boolean mask as an index, and any
  operator whose output's shape depends on device values (fake tensors have no values to size it by: on a GPU
  the host would read them); nested tensors (their list copied a kernel per tensor; `to_padded_tensor` copies
  sizes from pageable memory with a blocking copy);
- a copy from host to device from memory that is not pinned, or not non_blocking (from pageable memory CUDA
  stages the copy and the host waits for the stream's queue);
- an explicit wait: torch.cuda.synchronize, Event/Stream.synchronize.
And it counts the operators that touch a device tensor (views apart: they launch nothing), to compare runs of
several batch sizes or decoder layouts (`Audit.ops`).

Threads: --decode gpu's feed runs in two threads besides the training thread (feed.decoded_in_two_threads: one
runs BatchDecoder.decoded, the other BatchDecoder.finished), and the audit runs that real feed: feed's threads are
started under the modes of the thread that started them, the same FakeTensorMode and the same Audit. Per-thread
fake modes are no way out: a FakeTensor belongs to the mode that made it and another mode refuses it ("Mixing fake
modes NYI"), while the decoded images are made in one thread and cropped in the other; converting them at the
crossing would audit copies, not the feed. One shared mode, then, made safe for threads in two ways
(ThreadedFakeTensorMode):
- one lock (reentrant) held across each whole fake dispatch, FakeTensorMode's own handling included (its caches,
  its converter's memo of host tensors, its counters), and across the Audit's checks and counts around it (and
  the mode's entries and exits: its dispatch enters it again): fake dispatches run one at a time, in whichever
  thread, as if one thread ran them all;
- the state FakeTensorMode keeps per mode but that is per thread in torch (its own comments say it is not thread
  safe): `in_kernel_invocation`, which mirrors the thread's own dispatch keys (a thread inside a kernel sees its
  tensors on `meta`) and `enter_stack`, which mirrors the thread's own mode stack, are kept per thread. A lock
  alone would not do: a thread reading `tensor.device` outside any dispatch (the feed's own branches) while
  another is inside a kernel would be told `meta`, and take the wrong branch.
An Audit's pause (a library's own call, `unaudited`) is per thread too: the decoding thread inside the JPEG
library's call leaves the other thread's crops audited (tests/data/device/test_dispatch_audit.py plants a host read in
`finished` while the decoding thread is paused). A host wait fails in whichever thread makes it; feed hands the
AuditFailure to the training thread, in order, as it does every error of its threads.

What it cannot see: a wait inside an operator's CUDA code that SYNCHRONIZING does not name; the work inside an
operator's own kernel (an explicit operator is one operator here, however many kernels it launches: the canvas's per-
image copies are counted by tests/data/device/test_batch_crops.py with the profiler); the backward pass's kernels (the
autograd engine needs a driver for a graph on the device: FakeCuda.backward stands in); and a host tensor made inside
the audit has no values to read. tests/gpu/test_cuda.py's sync-debug mode and profiler runs on a GPU remain the proof;
this catches what they would catch, earlier, in CI.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DEVICE = torch.device("cuda")

HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal"}
# Operators whose CUDA implementation waits for the device, and why (read from torch's CUDA sources).
SYNCHRONIZING = {
    **dict.fromkeys(("nonzero", "nonzero_numpy", "argwhere", "masked_select", "_unique", "_unique2", "unique_dim",
                     "unique_consecutive", "unique_dim_consecutive"),
                    "its output's size is a count the host reads from the device"),
    "bincount": "the host reads the largest value to size the output",
    "to_padded_tensor": "copies the nested sizes to the device from pageable memory, a blocking copy",
    "_nested_tensor_from_tensor_list": "a nested tensor copies each tensor of its list in a kernel of its own, and "
                                       "its to_padded_tensor copies its sizes with a blocking copy",
}
# In-place operators that fake tensors have no kernel for: their outputs are their inputs, whose shapes stay.
NO_FAKE_KERNEL = {"_fused_sgd_", "_fused_adam_", "_fused_adamw_", "_fused_adagrad_"}
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}
COPIES = {"_to_copy", "copy_", "copy"}


class AuditFailure(AssertionError):
    """What would make the host wait for the GPU, at the operator that does it."""


def on_device(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def on_host(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def storage_key(tensor: torch.Tensor) -> int:
    """The storage's identity, shared by every view of it."""
    return tensor.untyped_storage()._cdata


class Audit(TorchDispatchMode):
    """One audited region: the rules checked at every operator, the device operators counted by name."""

    def __init__(self, pinned: dict[int, torch.Tensor], lock: threading.RLock, paused: bool = False) -> None:
        super().__init__()
        self.pinned, self.lock = pinned, lock
        self.ops: Counter[str] = Counter()
        self.paused_by_default = paused
        self.threads = threading.local()

    @property
    def paused(self) -> bool:
        """Whether this thread's operators go unchecked and uncounted (per thread: see the module's Threads)."""
        return getattr(self.threads, "paused", self.paused_by_default)

    @paused.setter
    def paused(self, paused: bool) -> None:
        self.threads.paused = paused

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Neither checked nor counted meanwhile (a stand-in for a library's own call)."""
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with self.lock:  # the checks, FakeTensorMode's dispatch inside `func` and the count: one thread at a time
            return self.dispatch(func, args, kwargs or {})

    def dispatch(self, func: Any, args: Any, kwargs: dict) -> Any:
        if func.overloadpacket.__name__ in NO_FAKE_KERNEL:
            if not self.paused:
                self.check(func, args, kwargs)
                self.ops[str(func)] += 1
            return None
        audited = not self.paused and func.namespace != "prim"
        if audited:
            self.check(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            if not any(on_device(t) for t in tree_leaves((args, kwargs))):  # no wait: a limit of fake tensors
                raise RuntimeError(f"{func} reads a host tensor made inside the audit, which has no values here: "
                                   "make it before the audit") from None
            raise AuditFailure(f"{func}: its output depends on device values, which the host must read "
                               f"({type(error).__name__})") from None
        except UnsupportedOperatorException:
            why = SYNCHRONIZING.get(func.overloadpacket.__name__, "no fake kernel: the audit cannot see if it waits")
            raise AuditFailure(f"{func}: {why}") from None
        if kwargs.get("pin_memory") and on_host(out):
            self.pinned[storage_key(out)] = out
        if audited and not func.is_view and any(on_device(t) for t in tree_leaves((args, kwargs, out))):
            self.ops[str(func)] += 1
        return out

    def check(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = func.overloadpacket.__name__
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = any(on_device(t) for t in tensors)
        if device and name in HOST_READS:
            raise AuditFailure(f"{func}: the host reads a device value (.item(), bool(), .tolist()) and waits for it")
        if device and name in SYNCHRONIZING:
            raise AuditFailure(f"{func}: {SYNCHRONIZING[name]}")
        if device and func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise AuditFailure(f"{func} without output_size: the host reads the output's size from the device")
        if device and name in INDEXING and any(t.dtype in (torch.bool, torch.uint8) for t in tree_leaves(args[1])
                                               if isinstance(t, torch.Tensor)) and not masked_fill(args, kwargs):
            raise AuditFailure(f"{func} with a boolean mask: the mask becomes positions through nonzero, whose size "
                               "the host reads from the device")
        if name in COPIES:
            self.check_copy(func, args, kwargs)

    def check_copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func.overloadpacket.__name__ == "_to_copy":
            source, target_device = args[0], kwargs.get("device") or args[0].device
            target = None  # a new tensor: torch pins it itself for a non_blocking copy to the host
        else:
            target, source = args[0], args[1]
            target_device = target.device
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        if on_host(source) and torch.device(target_device).type == "cuda":
            if not non_blocking or storage_key(source) not in self.pinned:
                why = "from memory that is not pinned" if non_blocking else "that is not non_blocking"
                raise AuditFailure(f"{func}: a copy to the device {why}: the host waits for the stream's queue")
        elif on_device(source) and torch.device(target_device).type == "cpu" and (
                not non_blocking or (target is not None and storage_key(target) not in self.pinned)):
            raise AuditFailure(f"{func}: a copy to the host that waits for the device")


def assert_counts_agree(counts: dict[Any, int]) -> None:
    """The device operators of runs that differ only in what must not change them (batch size, decoder layout):
    one count, or the path does work per image (or per layout) on the device."""
    if len(set(counts.values())) > 1:
        raise AuditFailure(f"operators on the device differ between runs: {counts}")


def masked_fill(args: tuple, kwargs: dict) -> bool:
    """Whether an index_put_ is `tensor[mask] = scalar`, which torch runs as masked_fill_ (no positions, no wait):
    one mask on the tensor's device, a one-element host value, no accumulation."""
    if len(args) < 3:
        return False
    target, indices, value = args[:3]
    masks = [i for i in indices if i is not None]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return (not accumulate and on_host(value) and value.numel() == 1 and len(masks) == 1
            and masks[0].dtype in (torch.bool, torch.uint8) and masks[0].device == target.device)


class StandInEvent:
    """torch.cuda.Event without CUDA: recorded, waited on by streams; the host waiting for it fails an audit."""

    def __init__(self, cuda: FakeCuda, *args: Any, **kwargs: Any) -> None:
        self.cuda = cuda

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        self.cuda.host_waits("Event.synchronize")


class StandInStream:
    """torch.cuda.Stream without CUDA: its events and waits recorded as nothing, its synchronize a host wait."""

    cuda_stream = 0

    def __init__(self, cuda: FakeCuda, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.cuda, self.device, self.priority = cuda, device, priority

    def record_event(self, event: Optional[StandInEvent] = None) -> StandInEvent:
        return event if event is not None else StandInEvent(self.cuda)

    def wait_event(self, event: StandInEvent) -> None:
        pass

    def wait_stream(self, stream: StandInStream) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.cuda.host_waits("Stream.synchronize")


class PerThread(threading.local):
    """FakeTensorMode's state that is per thread in torch (see ThreadedFakeTensorMode), as a new thread starts."""

    def __init__(self) -> None:
        self.in_kernel_invocation = False
        self.enter_stack: list[tuple[bool, Any, Any]] = []


class ThreadedFakeTensorMode(FakeTensorMode):
    """One FakeTensorMode for several threads (the module's Threads): each fake dispatch, whole, under `lock`, and
    the state that mirrors a thread's own dispatch keys and mode stack kept per thread."""

    def __init__(self, lock: threading.RLock, **kwargs: Any) -> None:
        self.lock, self.per_thread = lock, PerThread()  # before FakeTensorMode.__init__ sets the two below
        super().__init__(**kwargs)

    @property  # type: ignore[override]
    def in_kernel_invocation(self) -> bool:
        return self.per_thread.in_kernel_invocation

    @in_kernel_invocation.setter
    def in_kernel_invocation(self, inside: bool) -> None:
        self.per_thread.in_kernel_invocation = inside

    @property  # type: ignore[override]
    def enter_stack(self) -> list[tuple[bool, Any, Any]]:
        return self.per_thread.enter_stack

    @enter_stack.setter
    def enter_stack(self, stack: list[tuple[bool, Any, Any]]) -> None:
        self.per_thread.enter_stack = stack

    def __torch_dispatch__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return super().__torch_dispatch__(*args, **kwargs)

    def __enter__(self) -> ThreadedFakeTensorMode:
        with self.lock:
            return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        with self.lock:
            super().__exit__(*args)


class FakeCuda:
    """CUDA as the audited code sees it on a CPU: fake device tensors, pinning tagged, streams standing in.

    `fake()` makes tensors on the device (a model moved there, a warm-up batch) unaudited; `audit()` audits what
    runs inside it. Threads started meanwhile by feed.py run under the same modes (--decode gpu's two threads),
    their fake dispatches one at a time (the module's Threads)."""

    def __init__(self) -> None:
        self.pinned: dict[int, torch.Tensor] = {}  # storage -> a tensor keeping it alive (the key is its address)
        self.lock = threading.RLock()  # every fake dispatch, whole, in whichever thread
        self.mode = ThreadedFakeTensorMode(self.lock, allow_non_fake_inputs=True)
        self.current: Optional[Audit] = None  # the innermost fake() or audit() (the thread that runs the test's)
        self.streams: dict[Any, StandInStream] = {}

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            raise RuntimeError(f"cannot pin a {tensor.device} tensor: only host memory is pinned")
        pinned = tensor.clone()
        self.pinned[storage_key(pinned)] = pinned
        return pinned

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return on_host(tensor) and storage_key(tensor) in self.pinned

    def host_waits(self, what: str) -> None:
        if self.current is not None and not self.current.paused:
            raise AuditFailure(f"{what}: the host waits for the device")

    @contextlib.contextmanager
    def unaudited(self) -> Iterator[None]:
        with self.current.pause() if self.current is not None else contextlib.nullcontext():
            yield

    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """`Tensor.backward` without CUDA: the autograd engine asks the driver for the streams of a graph on the
        device, which it cannot without a GPU. Each leaf the graph reaches gets a gradient of its own shape and
        layout (or keeps the one it accumulates into), made unaudited: the backward's kernels are torch's own."""
        with self.unaudited():
            nodes, seen = [tensor.grad_fn], set()
            while nodes:
                node = nodes.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                leaf = getattr(node, "variable", None)  # an AccumulateGrad node's parameter
                if leaf is not None and leaf.grad is None:
                    leaf.grad = torch.zeros_like(leaf)
                nodes.extend(following for following, _ in node.next_functions)

    def current_stream(self, device: Any = None) -> StandInStream:
        return self.streams.setdefault(str(device), StandInStream(self, device))

    @contextlib.contextmanager
    def fake(self) -> Iterator[None]:
        """Fake device tensors, nothing audited (a paused audit still runs what fake tensors lack a kernel for,
        and holds the lock)."""
        with self.audited(Audit(self.pinned, self.lock, paused=True)):
            yield

    @contextlib.contextmanager
    def audit(self) -> Iterator[Audit]:
        with self.audited(Audit(self.pinned, self.lock)) as audit:
            yield audit

    @contextlib.contextmanager
    def audited(self, audit: Audit) -> Iterator[Audit]:
        outer, self.current = self.current, audit
        try:
            with self.mode, audit:
                yield audit
        finally:
            self.current = outer

    def thread_class(self) -> type[threading.Thread]:
        cuda = self

        class AuditedThread(threading.Thread):
            """A thread that runs under the modes of the one that started it (they are per thread), paused if
            that one was when it started it."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.audit = cuda.current
                self.paused = self.audit is not None and self.audit.paused

            def run(self) -> None:
                with contextlib.ExitStack() as modes:
                    modes.enter_context(cuda.mode)
                    if self.audit is not None:
                        modes.enter_context(self.audit)
                        self.audit.paused = self.paused  # this thread's
                    super().run()

        return AuditedThread


def device_caches() -> list[Any]:
    """The package's functools caches (device tensors made once, streams made once): emptied before and after, so
    that no fake tensor or stand-in stream outlives the audit and no real one enters it."""
    caches = []
    for name, module in list(sys.modules.items()):
        if name.startswith("imagenet_elastic") and module is not None:
            caches.extend(value for value in vars(module).values() if callable(getattr(value, "cache_clear", None)))
    return caches


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeCuda]:
    """A FakeCuda, its stand-ins in place of torch's (pinning, streams, events, synchronize) meanwhile."""
    from imagenet_elastic.data.device import feed

    cuda = FakeCuda()
    replaced = [(torch.Tensor, "pin_memory", lambda tensor, *args, **kwargs: cuda.pin(tensor)),
                (torch.Tensor, "is_pinned", lambda tensor, *args: cuda.is_pinned(tensor)),
                (torch.Tensor, "record_stream", lambda tensor, stream: None),
                (torch.Tensor, "backward", lambda tensor, *args, **kwargs: cuda.backward(tensor)),
                (torch.cuda.amp.common, "amp_definitely_not_available", lambda: False),  # autocast, GradScaler
                (torch.utils._foreach_utils, "_foreach_supported_types", [torch.Tensor, FakeTensor]),  # as on CUDA
                (torch.cuda, "Stream", functools.partial(StandInStream, cuda)),
                (torch.cuda, "Event", functools.partial(StandInEvent, cuda)),
                (torch.cuda, "current_stream", cuda.current_stream),
                (torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
                (torch.cuda, "device", lambda device: contextlib.nullcontext()),
                (torch.cuda, "synchronize", lambda device=None: cuda.host_waits("torch.cuda.synchronize")),
                (feed, "threading", types.SimpleNamespace(Thread=cuda.thread_class(), Event=threading.Event))]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    for cache in device_caches():
        cache.cache_clear()
    try:
        for owner, name, value in replaced:
            setattr(owner, name, value)
        yield cuda
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        for cache in device_caches():
            cache.cache_clear()
