"""`python bench/benchmark.py DATA --mode device_ops`: the operators `--decode gpu`'s device path dispatches per batch.

On a GPU each operator is a kernel launch from the decoding thread, with its Python and dispatch cost on the host;
the path is meant to dispatch a fixed number per batch, whatever the batch size, so this counts them for batches of
64, 128 and 256 real images from DATA (each sample's choices drawn as a loader worker draws them), with the
run's --auto-augment and --random-erase. The device is the run's (`--device`): on a CPU the same path runs on CPU
tensors, which is how it is measured without a GPU. The decoder call itself (nvJPEG's one batched call on a GPU,
one call per image on the CPU) is counted apart, as `decoder_calls`. The tests count operators with `OpCounter` too.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from imagenet_elastic.data import pipeline, sources
from imagenet_elastic.data.augment import Augment
from imagenet_elastic.data.device import gpu_decode

BATCH_SIZES = (64, 128, 256)


class OpCounter(TorchDispatchMode):
    """Operators that reach a kernel (views excluded), by name; nothing is counted while `paused`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and not self.paused:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


def count_batch(decoder: gpu_decode.BatchDecoder, batch: pipeline.Batch) -> dict[str, Any]:
    """Operators of one `decoder(batch)`, the JPEG library's own calls apart."""
    counter, calls = OpCounter(), [0]
    library = decoder.jpeg
    decode = library.decode

    def counted_decode(data: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        calls[0] += 1
        with counter.pause():
            return decode(data)

    library.decode = counted_decode  # type: ignore[method-assign]
    try:
        with counter:
            out = decoder(batch)
        if out.images.is_cuda:
            torch.cuda.synchronize(out.images.device)
    finally:
        del library.decode
    return {"ops": counter.count, "decoder_calls": calls[0], "top_ops": dict(counter.ops.most_common(6))}


def run_device_ops(args: argparse.Namespace, train: sources.Source, device: torch.device) -> list[dict[str, Any]]:
    augment = Augment(policy=args.auto_augment, erase=args.random_erase)
    dataset = pipeline.TrainDataset(train, args.image_size, 0, gpu_decode.encode_bytes, augment)
    decoder = gpu_decode.BatchDecoder(device, lambda line: None)
    rows = []
    for size in BATCH_SIZES:
        batch = gpu_decode.collate([dataset[(0, i % len(train))] for i in range(size)])
        decoder(batch)  # the first call makes what later ones reuse (smoothing kernel, pixel grids)
        counted = count_batch(decoder, batch)
        rows.append({"batch": size, **counted, "ops_per_image": round(counted["ops"] / size, 2),
                     "image_size": args.image_size, "auto_augment": args.auto_augment,
                     "random_erase": args.random_erase, "device": str(device)})
    return rows
