"""The line every `imagenet-elastic benchmark` mode prints: one JSON object with the peak memory of the process that
measured it. A module of its own because the index and checkpoint modes print their own lines (the index mode's from
spawned processes, whose peaks they are): they need `emit` without importing benchmark.py, which imports them."""

from __future__ import annotations

import json
import resource
from typing import Any, Optional

import torch


def emit(mode: str, **fields: Any) -> None:
    print(json.dumps({"mode": mode, **fields, **memory_peaks()}), flush=True)


def memory_peaks() -> dict[str, Optional[float]]:
    """ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN is the largest child that has been waited for."""
    return {
        "peak_host_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_child_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None,
    }
