"""What a torch.profiler run of CUDA work says about where the host may have waited for the device, for
tests/gpu/test_cuda.py (tests/gpu/test_gpu_probes.py checks these on a CPU, on made-up events and on a real profile).

A copy from pageable host memory to the device can make the host wait for the copy's stream (CUDA stages it
through a pinned buffer) without torch asking, so sync-debug mode cannot see it. Kineto names every copy it
records `Memcpy HtoD (SOURCE -> Device)`, SOURCE being `Pageable` or `Pinned` (CUPTI's memory kinds), and gives
the stream it ran on as the event's `device_resource_id`.

Every kernel, copy and fill also takes an entry of CUDA's launch queue, about 1,024 deep: a host that queues
more than that behind a busy kernel blocks in a launch, which is no synchronization of ours (the first GPU
run's busy-stream check queued ~1,000 launches behind its kernel and failed that way).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch.autograd import DeviceType

LAUNCH_QUEUE = 1024  # launches CUDA queues before the next one blocks the host, about
_HOST_TO_DEVICE = re.compile(r"Memcpy HtoD \((?P<source>[^()]*?) -> ")


@dataclass(frozen=True)
class HostCopy:
    """One copy from host memory to the device, as the profiler recorded it."""

    source: str  # the host memory's kind: "Pageable" or "Pinned"
    stream: int  # CUPTI's id of the stream it ran on
    start_us: float

    @property
    def pageable(self) -> bool:
        return self.source == "Pageable"


def host_to_device_copies(events: Iterable[Any]) -> list[HostCopy]:
    """The copies from host memory to the device among a profile's events (`profile.events()`), in the order the
    device ran them."""
    copies = []
    for event in events:
        found = _HOST_TO_DEVICE.match(event.name)
        if found:
            copies.append(HostCopy(found["source"], event.device_resource_id, event.time_range.start))
    return sorted(copies, key=lambda copy: copy.start_us)


def device_work(events: Iterable[Any]) -> int:
    """How many kernels, copies and fills the device ran: each one took an entry of the launch queue. The ranges
    the profiler draws on the device's timeline for torch's own annotations (`Optimizer.step#SGD.step`) are no
    launch."""
    return sum(1 for event in events
               if event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False))
