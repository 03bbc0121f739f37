"""One training step (with gradient accumulation) and one exact validation pass."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from imagenet_elastic import distributed
from imagenet_elastic.data import Batch
from imagenet_elastic.mixing import Mixer

if TYPE_CHECKING:
    from imagenet_elastic.gpu_decode import BatchDecoder

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclass
class StepContext:
    """What a training or evaluation step needs besides the batch."""

    model: nn.Module  # the DDP wrapper when distributed
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    criterion: nn.Module  # loss.TrainLoss: takes class labels or soft targets
    device: torch.device
    amp_dtype: Optional[torch.dtype]
    channels_last: bool
    mixer: Optional[Mixer] = None  # --mixup-alpha / --cutmix-alpha
    clip_grad_norm: Optional[float] = None  # --clip-grad-norm

    def __post_init__(self) -> None:
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)
        self.batch_norms = [m for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None)


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float  # percent
    top5: float  # percent
    samples: int


def prepare_batch(images: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 NHWC already on the device (see `device_batches`) to normalised float NCHW.

    The permute of NHWC data already has channels_last strides, so that layout costs nothing; the
    other one is made while the pixels are uint8, a quarter of the bytes of float32.
    """
    images = images.permute(0, 3, 1, 2)
    if not ctx.channels_last:
        images = images.contiguous()
    return images.float().sub_(ctx.mean).div_(ctx.std), labels


def device_batches(batches: Iterable[Batch], device: torch.device, decoder: Optional[BatchDecoder] = None
                   ) -> Iterator[Batch]:
    """The loader's batches with images and labels on `device` (decoded there first under --decode gpu).

    Batches travel as uint8, a quarter of the bytes of float32. On CUDA the copy of the next batch runs
    on a side stream while the current one trains; the main stream waits for it only when it gets there.
    Under --decode gpu a thread of its own decodes and crops ahead (`decoded_ahead`), so nvJPEG's host
    work and the crops' launches overlap the training thread's. The policy and erasing, which draw from
    torch's process-wide generator, then run in the training thread, on a stream of their own
    (`SideStream`): torchvision's tensor kernels copy small host tensors (affine matrices, fill values)
    with blocking copies, each of which waits for its stream's queue, and on the training stream that
    queue is the previous step's forward and backward. Other entries (sample indices) stay on the host,
    so reading them never waits for the device.
    """
    if decoder is not None:
        def decode(batch: Batch) -> tuple[Batch, list[Optional[int]]]:
            decoded, seeds = decoder.decode_crops(batch)
            return decoded.to(device), seeds

        policy = SideStream(device)
        for (staged, seeds), ready in decoded_ahead(batches, decode, device):
            if decoder.draws_policy(seeds):
                with policy.run_after(ready, staged.images):
                    staged = decoder.augment_images(staged, seeds)
            take_on_current_stream(staged, ready, device)
            yield staged
        return
    if device.type != "cuda":
        yield from (batch.to(device) for batch in batches)
        return
    side, main = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    ahead = None
    for batch in batches:
        with torch.cuda.stream(side):
            staged = batch.to(device)
        if ahead is not None:
            yield ahead
        main.wait_stream(side)
        for tensor in (staged.images, staged.labels):
            tensor.record_stream(main)  # allocated on `side`: not reused before `main` is done with it
        ahead = staged
    if ahead is not None:
        yield ahead


class SideStream:
    """A CUDA stream for work that the host runs in the training thread but that must not wait behind the
    training stream's queue (nothing on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def run_after(self, ready: Optional[torch.cuda.Event], tensor: torch.Tensor) -> Iterator[None]:
        """The block's kernels queue on this stream after `ready` (the event that made `tensor`) and after
        nothing of the training stream's; the training stream then waits for them. A blocking copy in the
        block waits for this stream alone: the host goes on while the GPU trains."""
        if self.stream is None:
            yield
            return
        if ready is not None:
            self.stream.wait_event(ready)
        tensor.record_stream(self.stream)  # made on another stream: not reused before this one is done with it
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def take_on_current_stream(staged: Batch, ready: Optional[torch.cuda.Event], device: torch.device) -> None:
    """The current (training) stream waits for the event that made `staged`'s device tensors on another
    stream, and those tensors are not reused before the current stream is done with them."""
    if ready is None:
        return
    main = torch.cuda.current_stream(device)
    main.wait_event(ready)
    for tensor in (staged.images, staged.labels):
        tensor.record_stream(main)


_DONE = object()


def decoded_ahead(batches: Iterable, prepare: Callable[[Any], Any], device: torch.device, ahead: int = 2
                  ) -> Iterator[tuple[Any, Optional[torch.cuda.Event]]]:
    """`(prepare(batch), ready)` for each batch, run by a thread of its own up to `ahead` batches before they
    are taken; on CUDA on a stream of its own, whose event `ready` the taker waits for (None on a CPU). Its
    errors (a corrupt image) are raised here, in order; closing this generator stops the thread and waits
    for it, so the loader is never read by two threads."""
    results: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def hand_over(item: Any) -> None:
        while not stop.is_set():
            try:
                results.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def work() -> None:
        try:
            with contextlib.ExitStack() as scope:
                if stream is not None:  # the current device and stream are per thread
                    scope.enter_context(torch.cuda.device(device))
                    scope.enter_context(torch.cuda.stream(stream))
                for batch in batches:
                    staged = prepare(batch)
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
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # it may be waiting for a worker's batch or to hand one over
            with contextlib.suppress(queue.Empty):
                results.get(timeout=0.1)
        thread.join()


def seed_micro_batch(seed: int, step: int, position: int) -> None:
    """Model-side randomness (dropout, drop-path) of a micro-batch from (seed, step, its position in
    the global batch): a resumed step, or the same step at another world size, draws the same."""
    torch.manual_seed(int(np.random.SeedSequence([seed, step, position]).generate_state(1)[0]))


class LoaderWaits:
    """Wall time the training loop spent waiting for its next batch on the device (from the loader, and
    under --decode gpu from the decoding thread); each log line takes it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, batches: Iterable) -> Iterator:
        batches = iter(batches)
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.seconds += time.perf_counter() - start
            yield batch

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


@contextlib.contextmanager
def running_stats_frozen(batch_norms: list[nn.Module]) -> Iterator[None]:
    """Batch norm normalises with the micro-batch's statistics but leaves its running averages alone.

    Under DDP the running averages that survive are rank 0's (broadcast at every forward), i.e.
    those of the global batch's first slice. Updating them from the first micro-batch only keeps
    them the same at every world size, so an elastic run evaluates like an uninterrupted one. The
    batch counter is put back too, or it would count micro-batches and differ between world sizes.
    """
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
             for m in batch_norms]
    for m in batch_norms:
        m.momentum = 0.0  # running = running * (1 - 0) + batch * 0: unchanged, exactly
    try:
        yield
    finally:
        for m, (momentum, count) in zip(batch_norms, saved):
            m.momentum = momentum
            if count is not None:
                m.num_batches_tracked.copy_(count)  # in place: DDP keeps references to the buffers


def train_step(ctx: StepContext, micro_batches: list[Batch], slices: list[slice], share: int, lr: float, seed: int,
               step: int) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; returns the rank's mean loss (on device).

    Each micro-batch's loss is weighted by its share of the rank's samples, so the accumulated
    gradient is the mean over the rank's share, and DDP's average over ranks the mean over the
    global batch, whatever the split. Gradients are all-reduced once, on the last micro-batch.
    """
    for group in ctx.optimizer.param_groups:
        group["lr"] = lr
    ctx.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=ctx.device)
    for j, (batch, part) in enumerate(zip(micro_batches, slices)):
        images, targets = prepare_batch(batch.images, batch.labels, ctx)
        if ctx.mixer is not None:
            images, targets = ctx.mixer(images, targets, seed, step, part.start, ctx.channels_last)
        seed_micro_batch(seed, step, part.start)
        last = j == len(micro_batches) - 1
        with contextlib.ExitStack() as stack:
            if not last and hasattr(ctx.model, "no_sync"):
                stack.enter_context(ctx.model.no_sync())
            if part.start % share:  # not the first micro-batch of the rank's share
                stack.enter_context(running_stats_frozen(ctx.batch_norms))
            with ctx.autocast():
                loss = ctx.criterion(ctx.model(images), targets)
            weighted = loss * (len(batch) / share)  # x1.0 when there is one micro-batch: exact
            ctx.scaler.scale(weighted).backward()
        total += weighted.detach().float()
    if ctx.clip_grad_norm is not None:  # on the all-reduced gradient: every rank clips the same, at any world size
        ctx.scaler.unscale_(ctx.optimizer)  # the norm of the true gradient, not of the loss-scaled one
        torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), ctx.clip_grad_norm)
    ctx.scaler.step(ctx.optimizer)
    ctx.scaler.update()
    return total


@torch.no_grad()
def evaluate(ctx: StepContext, model: nn.Module, loader: Iterable[Batch], flip_average: bool = False) -> EvalResult:
    """Every rank runs its own shard on the *unwrapped* model (shards may differ in batch count, and
    DDP's forward would then wait on a collective), then the sums are added up across ranks.

    `flip_average` (--val-flip-average): the logits are the mean of the image's and its mirror's.
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, top-1, top-5
    samples = 0  # counted on the host: a tensor made per batch would be a blocking copy to the device
    for batch in loader:
        images, labels = prepare_batch(batch.images, batch.labels, ctx)
        with ctx.autocast():
            logits = model(images).float()
            if flip_average:
                logits = (logits + model(images.flip(3)).float()) / 2
        loss = F.cross_entropy(logits, labels, reduction="sum")
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices.eq(labels[:, None])
        totals += torch.stack([loss.double(), top[:, 0].sum().double(), top.any(dim=1).sum().double()])
        samples += len(labels)
    totals = torch.cat([totals, torch.tensor([float(samples)], dtype=torch.float64).to(ctx.device)])
    distributed.all_reduce_sum(totals)
    loss_sum, top1, top5, samples = totals.tolist()
    count = max(samples, 1.0)
    return EvalResult(loss=loss_sum / count, top1=100 * top1 / count, top5=100 * top5 / count, samples=int(samples))
