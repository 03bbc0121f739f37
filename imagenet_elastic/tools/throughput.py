"""Throughput for `imagenet-elastic benchmark`: the input pipeline against the textbook one, training
steps on batches already on the device, and both together. Each mode returns its figures."""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from imagenet_elastic.data import pipeline, sources
from imagenet_elastic.data.augment import Augment, make_policy
from imagenet_elastic.data.decoding import Decoding, Feed
from imagenet_elastic.data.device.feed import device_batches
from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.resolution import TrainSizes
from imagenet_elastic.data.sampler import BatchPlan, TrainBatchSampler
from imagenet_elastic.data.sources.image_folder import ImageFolder
from imagenet_elastic.launch.distributed import available_cores, uses_cuda
from imagenet_elastic.models.compile import CompiledOrEager
from imagenet_elastic.train.step import StepContext, train_step


def endless(make_iter: Callable[[int], Iterator]) -> Iterator:
    """Batches across epochs: epoch e's iterator is `make_iter(e)`."""
    for epoch in itertools.count():
        yield from make_iter(epoch)


def images_per_sec(batches: Iterator, count: int, warmup: int, ctx: Optional[StepContext] = None) -> float:
    """Images/s over `count` batches after `warmup` (worker start-up, compilation, cudnn autotuning), each a training
    step of `ctx` where given. Without one the consumer does no work, so the workers' prefetch queue is empty in
    steady state and does not flatter the rate."""
    images, start = 0, time.perf_counter()
    for i in range(warmup + count):
        if i == warmup:
            sync(ctx)
            start, images = time.perf_counter(), 0
        batch = received_whole(batches)
        if ctx is not None:
            train_step(ctx, [batch], [slice(0, len(batch))], len(batch), 0.1, seed=0, step=i)
        images += len(batch) if isinstance(batch, Batch) else len(batch[0])  # ours, or the textbook's [x, y]
    sync(ctx)
    return images / (time.perf_counter() - start)


def received_whole(batches: Iterator) -> Any:
    """The next batch, a Ctrl-C meanwhile raised once it has arrived (a second at once): cut short, the hand-over of
    its tensors' file descriptors would leave the loader worker that sent them printing the broken connection's
    traceback."""
    pending: list[int] = []

    def deferred(signum: int, _: Any) -> None:
        if pending:  # a second Ctrl-C: the batch is late (a stalled store, a hung worker), so stop now
            raise KeyboardInterrupt
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, deferred)
    try:
        batch = next(batches)
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt
    return batch


def interrupts_ignored(_: int) -> None:
    """A loader worker's: Ctrl-C reaches every process of the terminal's group, and a worker it ended would end the
    benchmark with the loader's "worker exited unexpectedly" rather than the one line of a Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def sync(ctx: Optional[StepContext]) -> None:
    if ctx is not None and ctx.input.device.type == "cuda":
        torch.cuda.synchronize(ctx.input.device)


def make_feed(args: argparse.Namespace, device: torch.device, workers: int, augment: Augment,
              gpu_decoder: str = "auto") -> Feed:
    """--decode chosen and set up on this machine as the trainer does it for one rank."""
    decoding = Decoding.choose(args.decode, device, available_cores(), augment, gpu_decoder)
    return decoding.feed(device, workers, available_cores(), 1, args.batch_size, args.image_size,
                         functools.partial(print, file=sys.stderr))


def ours_loader(source: sources.Source, feed: Feed, args: argparse.Namespace,
                augment: Augment) -> Callable[[int], Iterator]:
    """Our training loader over `source`, as the trainer makes it."""
    sampler = TrainBatchSampler(len(source), BatchPlan(args.batch_size, 1, args.batch_size), 0, seed=0)
    loader = feed.train_loader(source, TrainSizes(args.image_size), 0, augment, sampler, ignored=(signal.SIGINT,))
    pipeline.share_heap_with_workers()  # as the trainer does before its workers fork

    def epoch(e: int) -> Iterator:
        sampler.set_epoch(e)
        return iter(loader)
    return epoch


def textbook_loader(root: str, size: int, batch: int, workers: int, augment: Augment) -> Callable[[int], Iterator]:
    """torchvision's classification reference: PIL transforms, float tensors out of the workers; the policy before
    ToTensor and erasing after Normalize, as the reference places them."""
    import torchvision.datasets as datasets
    import torchvision.transforms as T

    policy = make_policy(augment.policy)
    transform = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), *([policy] if policy else []),
                           T.ToTensor(), T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
                           *([T.RandomErasing(p=augment.erase)] if augment.erase else [])])
    loader = DataLoader(datasets.ImageFolder(root, transform), batch_size=batch, shuffle=True, num_workers=workers,
                        pin_memory=torch.cuda.is_available(), drop_last=True, worker_init_fn=interrupts_ignored)
    return lambda _: iter(loader)


def run_loader(args: argparse.Namespace, train: sources.Source, workers: int,
               against: tuple[sources.Source, ...] = ()) -> dict[str, Any]:
    """Ours on DATA against the textbook loader (where DATA is a folder) and ours on each of `against`, in
    alternating rounds."""
    warmup = max(2, 2 * workers)
    augment = Augment(policy=args.auto_augment, erase=args.random_erase)
    feed = make_feed(args, run_device(args), workers, augment)  # gpu: the workers' part, not feed.decoder's
    contenders = {"ours": ours_loader(train, feed, args, augment)}
    if isinstance(train, ImageFolder):
        contenders["textbook"] = textbook_loader(train.root, args.image_size, args.batch_size, workers, augment)
    for k, other in enumerate(against):
        contenders[f"against {k}"] = ours_loader(other, feed, args, augment)
    rates = alternating_rounds(contenders, args, warmup)
    rate = {name: statistics.median(values) for name, values in rates.items()}
    figures: dict[str, Any] = {"data": train.where(), "ours_images_per_sec": round(rate["ours"], 1)}
    if "textbook" in rate:
        figures.update(textbook_images_per_sec=round(rate["textbook"], 1),
                       ratio=round(rate["ours"] / rate["textbook"], 2))
    if against:
        figures["against"] = [{"data": other.where(), "images_per_sec": round(rate[f"against {k}"], 1),
                               "ours_vs_this": round(rate["ours"] / rate[f"against {k}"], 2)}
                              for k, other in enumerate(against)]
    return {**figures, "rounds": {k: [round(r, 1) for r in v] for k, v in rates.items()}, "images": len(train),
            "batch_size": args.batch_size, "workers": workers, "image_size": args.image_size,
            "decode": feed.decoding.mode, "auto_augment": args.auto_augment, "random_erase": args.random_erase}


def alternating_rounds(contenders: dict[str, Callable[[int], Iterator]], args: argparse.Namespace,
                       warmup: int) -> dict[str, list[float]]:
    """Each contender's images/s in each of --rounds rounds, taken in turn so that the machine's drift touches all."""
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, make in contenders.items():
            rates[name].append(images_per_sec(endless(make), args.batches, warmup))
    return rates


def run_device(args: argparse.Namespace) -> torch.device:
    """--device: cuda, cpu, or auto (cuda where there is one)."""
    return torch.device("cuda" if uses_cuda(args.device) else "cpu")


def step_context(args: argparse.Namespace, num_classes: int) -> tuple[StepContext, dict[str, Any]]:
    from imagenet_elastic.models.create import create_model
    from imagenet_elastic.models.device import place_model, resolve_precision, use_fastest_kernels
    from imagenet_elastic.optim.optimizer import create_optimizer

    device = run_device(args)
    use_fastest_kernels(device)
    precision = resolve_precision(args.amp, device)
    if precision.warning:
        print(f"warning: {precision.warning}", file=sys.stderr)
    model = place_model(create_model(args.model, num_classes, blurpool=args.blurpool,
                                     sizes=((args.image_size, "--image-size"),)), device, args.channels_last)
    optimizer = create_optimizer(model, 0.1, 0.9, 1e-4, device)
    # compiled as the trainer compiles: the same graphs share caches, and a model that cannot compile is measured eager
    compiled = CompiledOrEager(model) if args.compile else model
    ctx = StepContext(compiled, optimizer, torch.amp.GradScaler(device.type, enabled=precision.dtype == torch.float16),
                      nn.CrossEntropyLoss(), ModelInput(device, precision.dtype, args.channels_last))
    settings = {"model": args.model, "batch_size": args.batch_size, "image_size": args.image_size,
                "device": str(device), "amp": precision.name, "amp_reason": precision.reason,
                "channels_last": args.channels_last, "compile": args.compile, "blurpool": args.blurpool}
    return ctx, settings


def run_synthetic(args: argparse.Namespace, num_classes: int = 1000,
                  context: Optional[tuple[StepContext, dict[str, Any]]] = None) -> dict[str, Any]:
    """`num_classes`: the data's, so the model and its graphs are end_to_end's; `context`: a step_context to reuse."""
    ctx, settings = context or step_context(args, num_classes)
    images = torch.randint(0, 256, (args.batch_size, args.image_size, args.image_size, 3), dtype=torch.uint8,
                           device=ctx.input.device)
    labels = torch.randint(0, num_classes, (args.batch_size,), device=ctx.input.device)
    rate = images_per_sec(itertools.repeat(Batch(images, labels)), args.batches, 10 if args.compile else 3, ctx)
    return {"images_per_sec": round(rate, 1), "num_classes": num_classes, **settings, **compiled_how(ctx)}


def run_end_to_end(args: argparse.Namespace, train: sources.Source, workers: int,
                   context: Optional[tuple[StepContext, dict[str, Any]]] = None) -> dict[str, Any]:
    """`context`: a step_context to reuse; the loader, its workers and the decoding thread end with the run."""
    ctx, settings = context or step_context(args, len(train.classes))
    augment = Augment(policy=args.auto_augment, erase=args.random_erase)
    feed = make_feed(args, ctx.input.device, workers, augment, args.gpu_decoder)
    batches = device_batches(endless(ours_loader(train, feed, args, augment)), ctx.input.device, feed.decoder)
    with contextlib.closing(batches):  # the decoding thread stops before the loader's workers go
        rate = images_per_sec(batches, args.batches, max(3, 2 * workers), ctx)
    decoding = feed.decoding
    return {"images_per_sec": round(rate, 1), "workers": workers, "prefetch": feed.prefetch, "images": len(train),
            "data": train.where(), "decode": decoding.mode, "decode_why": decoding.why,
            "gpu_decoder": decoding.library if decoding.mode == "gpu" else None,
            "auto_augment": args.auto_augment, "random_erase": args.random_erase, **settings, **compiled_how(ctx)}


def compiled_how(ctx: StepContext) -> dict[str, Any]:
    """A compiled model's outcome: how long its first call took to compile, or why it runs eager."""
    if not isinstance(ctx.model, CompiledOrEager):
        return {}
    seconds = ctx.model.compile_seconds
    return {"compile_seconds": None if seconds is None else round(seconds, 1), "compile_failure": ctx.model.failure}
