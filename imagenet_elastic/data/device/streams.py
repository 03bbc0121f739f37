"""Where the input side queues its device work: the question it asks of a device (`on_cuda`), and the two streams
that copy, decode, crop and augment batches beside the training stream, in one place for tests/stream_audit.py."""

from __future__ import annotations

import functools

import torch


def on_cuda(device: torch.device) -> bool:
    """Whether work for `device` is queued on CUDA streams (the stream audit answers yes for CPU tensors)."""
    return device.type == "cuda"


@functools.cache
def feeding_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that copies, crops and augments batches for `device`: once per process, at high priority, so its
    short kernels are scheduled ahead of the training stream's queue instead of behind a whole forward and backward."""
    return torch.cuda.Stream(device, priority=-1)  # lower is higher; torch maps it into the device's range


@functools.cache
def decoding_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream --decode gpu's decoding thread decodes on, beside the feeding stream, so the decoders' host waits
    see only decoding; high priority, once per process. torch hands out 32 pooled streams per priority round robin:
    this differs from the feeding stream unless 31 more were made in between, and their order holds even then."""
    return torch.cuda.Stream(device, priority=-1)
