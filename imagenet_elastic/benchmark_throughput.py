"""Throughput for `imagenet-elastic benchmark`: the input pipeline against the textbook one, training
steps on batches already on the device, and both together. Each mode returns its figures."""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from imagenet_elastic import data, gpu_decode
from imagenet_elastic.augment import INCEPTION_CROP, Augment, make_policy
from imagenet_elastic.engine import StepContext, device_batches, train_step
from imagenet_elastic.file_index import ImageIndex, scan_image_folder
from imagenet_elastic.sampler import BatchPlan, TrainBatchSampler

# ----------------------------------------------------------------------------- loader

def endless(make_iter: Callable[[int], Iterator]) -> Iterator:
    """Batches across epochs: epoch e's iterator is `make_iter(e)`."""
    for epoch in itertools.count():
        yield from make_iter(epoch)


def images_per_sec(batches: Iterator, count: int, warmup: int) -> float:
    """Skips `warmup` batches (worker start-up), then times `count`; the consumer does no work, so the
    workers' prefetch queue is empty in steady state and does not flatter the rate."""
    for _ in range(warmup):
        next(batches)
    start, images = time.perf_counter(), 0
    for _ in range(count):
        images += len(next(batches)[0])
    return images / (time.perf_counter() - start)


def ours_loader(index: ImageIndex, size: int, batch: int, workers: int, encoded: bool = False,
                augment: Augment = INCEPTION_CROP) -> Callable[[int], Iterator]:
    sampler = TrainBatchSampler(len(index), BatchPlan(batch, 1, batch), 0, seed=0)
    load, collate = gpu_decode.worker_functions("gpu" if encoded else "cpu")
    loader = data.train_loader(data.TrainDataset(index, size, 0, load, augment), sampler, workers,
                               torch.cuda.is_available(), collate=collate)
    data.share_heap_with_workers()  # as the trainer does before its workers fork

    def epoch(e: int) -> Iterator:
        sampler.set_epoch(e)
        return iter(loader)
    return epoch


def textbook_loader(root: str, size: int, batch: int, workers: int,
                    augment: Augment = INCEPTION_CROP) -> Callable[[int], Iterator]:
    """torchvision's classification reference: PIL transforms, float tensors out of the workers; the
    policy before ToTensor and erasing after Normalize, as the reference places them."""
    import torchvision.datasets as datasets
    import torchvision.transforms as T

    policy = make_policy(augment.policy)
    transform = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), *([policy] if policy else []),
                           T.ToTensor(), T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
                           *([T.RandomErasing(p=augment.erase)] if augment.erase else [])])
    loader = DataLoader(datasets.ImageFolder(root, transform), batch_size=batch, shuffle=True, num_workers=workers,
                        pin_memory=torch.cuda.is_available(), drop_last=True)
    return lambda _: iter(loader)


def run_loader(args: argparse.Namespace, train_dir: str, workers: int) -> dict[str, Any]:
    index = scan_image_folder(train_dir, "train")
    warmup = max(2, 2 * workers)
    augment = Augment(policy=args.auto_augment, erase=args.random_erase)
    contenders = {"ours": ours_loader(index, args.image_size, args.batch_size, workers, augment=augment),
                  "textbook": textbook_loader(train_dir, args.image_size, args.batch_size, workers, augment)}
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, make in contenders.items():
            rates[name].append(images_per_sec(endless(make), args.batches, warmup))
    ours, textbook = statistics.median(rates["ours"]), statistics.median(rates["textbook"])
    return {"ours_images_per_sec": round(ours, 1), "textbook_images_per_sec": round(textbook, 1),
            "ratio": round(ours / textbook, 2), "rounds": {k: [round(r, 1) for r in v] for k, v in rates.items()},
            "images": len(index), "batch_size": args.batch_size, "workers": workers, "image_size": args.image_size,
            "auto_augment": args.auto_augment, "random_erase": args.random_erase}


# ----------------------------------------------------------------------------- model

def step_context(args: argparse.Namespace, num_classes: int) -> tuple[StepContext, dict[str, Any]]:
    from imagenet_elastic.model import (
        create_model,
        create_optimizer,
        place_model,
        resolve_precision,
    )

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    precision = resolve_precision(args.amp, device)
    if precision.warning:
        print(f"warning: {precision.warning}", file=sys.stderr)
    amp = precision.dtype
    channels_last = args.channels_last
    model = place_model(create_model(args.model, num_classes, blurpool=args.blurpool), device, channels_last)
    optimizer = create_optimizer(model, 0.1, 0.9, 1e-4, device)
    compiled = torch.compile(model) if args.compile else model
    ctx = StepContext(compiled, optimizer, torch.amp.GradScaler(device.type, enabled=amp == torch.float16),
                      nn.CrossEntropyLoss(), device, amp, channels_last)
    settings = {"model": args.model, "batch_size": args.batch_size, "image_size": args.image_size,
                "device": str(device), "amp": precision.name, "amp_reason": precision.reason,
                "channels_last": channels_last, "compile": args.compile, "blurpool": args.blurpool}
    return ctx, settings


def timed_steps(ctx: StepContext, batches: Iterator, count: int, warmup: int) -> float:
    """Training images/s over `count` steps after `warmup` (compilation, cudnn autotuning)."""
    images, start = 0, time.perf_counter()
    for i in range(warmup + count):
        if i == warmup:
            sync(ctx.device)
            start, images = time.perf_counter(), 0
        batch = next(batches)
        train_step(ctx, [batch], [slice(0, len(batch[1]))], len(batch[1]), 0.1, seed=0, step=i)
        images += len(batch[1])
    sync(ctx.device)
    return images / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_synthetic(args: argparse.Namespace) -> dict[str, Any]:
    ctx, settings = step_context(args, 1000)
    images = torch.randint(0, 256, (args.batch_size, args.image_size, args.image_size, 3), dtype=torch.uint8,
                           device=ctx.device)
    labels = torch.randint(0, 1000, (args.batch_size,), device=ctx.device)
    batch = (images, labels, None)
    rate = timed_steps(ctx, itertools.repeat(batch), args.batches, warmup=10 if args.compile else 3)
    return {"images_per_sec": round(rate, 1), **settings}


def run_end_to_end(args: argparse.Namespace, train_dir: str, workers: int) -> dict[str, Any]:
    index = scan_image_folder(train_dir, "train")
    ctx, settings = step_context(args, len(index.classes))
    encoded = args.decode == "gpu"
    augment = Augment(policy=args.auto_augment, erase=args.random_erase)
    loader = ours_loader(index, args.image_size, args.batch_size, workers, encoded, augment)
    decoder = (gpu_decode.BatchDecoder(ctx.device, lambda line: print(line, file=sys.stderr), augment)
               if encoded else None)
    batches = device_batches(endless(loader), ctx.device, decoder)
    rate = timed_steps(ctx, batches, args.batches, warmup=max(3, 2 * workers))
    return {"images_per_sec": round(rate, 1), "workers": workers, "images": len(index), "decode": args.decode,
            "auto_augment": args.auto_augment, "random_erase": args.random_erase, **settings}
