"""Where the input side queues its device work: the question it asks of a device (`on_cuda`), and the two streams
that copy, decode, crop and augment batches beside the training stream. One place, so the stream-discipline audit
(tests/stream_audit.py) answers that question for CPU tensors and records these streams."""

from __future__ import annotations

import functools

import torch


def on_cuda(device: torch.device) -> bool:
    """Whether work for `device` is queued on CUDA streams, whose order events must keep: the one question the
    feeding and decoding code asks of a device for that, so that the stream-discipline audit (tests) can answer
    it yes for CPU tensors and check the order with recording streams."""
    return device.type == "cuda"


@functools.cache
def feeding_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that copies, crops and augments batches for `device`: made once per process (not per epoch
    or validation pass), at high priority, so that its short kernels are scheduled ahead of the training
    stream's queue instead of waiting behind a whole forward and backward."""
    return torch.cuda.Stream(device, priority=-1)  # lower is higher; torch maps it into the device's range


@functools.cache
def decoding_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream --decode gpu's decoding thread decodes on (nvImageCodec's kernels, torchvision's wait for its
    own stream), beside the feeding stream: the crops of one batch and the decode of the next are queued by two
    threads, and the decoders' own host waits (nvImageCodec waits for its previous batch) see only decoding.
    High priority as the feeding stream; once per process. torch hands out streams from a pool of 32 per
    priority, round robin: this one is another than the feeding stream unless 31 more were made in between, and
    the order of their work holds even then (events between them become no-ops)."""
    return torch.cuda.Stream(device, priority=-1)
