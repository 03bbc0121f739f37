"""One training step (with gradient accumulation) and its loss, and one exact validation pass."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from imagenet_elastic.data.model_input import ModelInput, prepare_batch
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.errors import one_line
from imagenet_elastic.launch import distributed
from imagenet_elastic.train.distillation import Distillation
from imagenet_elastic.train.mixing import Mixer


@dataclass
class StepContext:
    """What a training step needs besides the batch."""

    model: nn.Module  # the DDP wrapper when distributed
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    criterion: nn.Module  # TrainLoss: takes class labels or soft targets
    input: ModelInput
    mixer: Optional[Mixer] = None  # --mixup-alpha / --cutmix-alpha
    clip_grad_norm: Optional[float] = None  # --clip-grad-norm
    recomputes: bool = False  # --grad-checkpointing: the backward pass runs the blocks' forward again
    distillation: Optional[Distillation] = None  # --teacher

    def __post_init__(self) -> None:
        self.running_stats = RunningStats([m for m in self.model.modules()
                                           if isinstance(m, nn.modules.batchnorm._BatchNorm)])

    @property
    def parts(self) -> tuple[str, ...]:
        """What a step tallies beside its loss (the names of the rest of the vector `train_step` returns)."""
        return self.distillation.parts if self.distillation is not None else ()


class TrainLoss(nn.Module):
    """Cross-entropy or timm's binary cross-entropy, with label smoothing. `loss(logits, targets)`: targets are class
    indices, or probabilities not yet smoothed (mixing.Mixer's). Smoothing moves a probability target towards uniform
    (t (1 - s) + s / classes), as torch's cross-entropy and timm's BCE do for an index; timm's BCE expects smoothed
    targets (its Mixup smooths them), so they are smoothed here."""

    def __init__(self, label_smoothing: float, bce: bool = False, bce_threshold: Optional[float] = None) -> None:
        super().__init__()
        self.smoothing, self.bce = label_smoothing, bce
        if bce:
            from timm.loss import BinaryCrossEntropy

            self.loss: nn.Module = BinaryCrossEntropy(smoothing=label_smoothing, target_threshold=bce_threshold)
        else:
            self.loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.bce and targets.is_floating_point() and self.smoothing:
            targets = targets * (1.0 - self.smoothing) + self.smoothing / logits.shape[-1]
        return self.loss(logits, targets)


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float  # percent
    top5: float  # percent
    samples: int
    counts: dict[str, float] = field(default_factory=dict)  # Counts' sums over every rank


@dataclass(frozen=True)
class Counts:
    """Further sums a validation pass adds up over its images, exactly across ranks (ReaL's correct and counted
    images): `count(logits, batch)` gives a float64 tensor of `len(names)` sums for one batch."""

    names: tuple[str, ...]
    count: Callable[[torch.Tensor, Batch], torch.Tensor]


class BufferCopy:
    """Buffers copied by `keep` and put back in place by `restore` (DDP keeps references to them): one multi-tensor
    copy per device and dtype, on the device, unwaited."""

    def __init__(self, buffers: Iterable[torch.Tensor]) -> None:
        self.buffers = list(buffers)
        self.groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for buffer in self.buffers:
            live, copies = self.groups.setdefault((buffer.device, buffer.dtype), ([], []))
            live.append(buffer)
            copies.append(torch.empty_like(buffer))

    def keep(self) -> None:
        for live, copies in self.groups.values():
            torch._foreach_copy_(copies, live)

    def restore(self) -> None:
        with torch.no_grad():
            for live, copies in self.groups.values():
                torch._foreach_copy_(live, copies)


class RunningStats:
    """Only the first micro-batch of each rank's share updates batch norm's running averages and counter (`frozen`
    around the others): the surviving ones are the global batch's first slice's, at any world size. Frozen means
    copied and written back, not momentum set to 0: a compiled forward guards on the momentum (a float), so an
    accumulating run would recompile at its second micro-batch and keep two graphs."""

    def __init__(self, batch_norms: list[nn.Module]) -> None:
        self.batch_norms = batch_norms
        self.copy = BufferCopy(())

    def buffers(self) -> list[torch.Tensor]:
        return [b for m in self.batch_norms for b in (m.running_mean, m.running_var, m.num_batches_tracked)
                if b is not None]

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        buffers = self.buffers()
        if len(buffers) != len(self.copy.buffers) or any(a is not b for a, b in zip(buffers, self.copy.buffers)):
            self.copy = BufferCopy(buffers)  # first use, or a module moved since (`.to()` makes new buffers)
        self.copy.keep()
        try:
            yield
        finally:
            self.copy.restore()


def micro_batch_loss(model: nn.Module, criterion: nn.Module, distillation: Optional[Distillation], images: torch.Tensor,
                     targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss a micro-batch's backward pass starts from, and what the step tallies of it (float32, detached): the
    loss alone, or under --teacher [loss, task loss, distillation loss] (distillation.py)."""
    outputs = model(images)
    if distillation is not None:
        return distillation(outputs, targets, images, criterion)
    loss = criterion(outputs, targets)
    return loss, loss.detach().float().reshape(1)


def train_step(ctx: StepContext, micro_batches: list[Batch], slices: list[slice], share: int, lr: float, seed: int,
               step: int) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; returns its mean loss and parts (`ctx.parts`), on device."""
    total = accumulate(ctx, micro_batches, slices, share, seed, step)
    apply_gradients(ctx, lr)
    return total


def accumulate(ctx: StepContext, micro_batches: list[Batch], slices: list[slice], share: int, seed: int,
               step: int) -> torch.Tensor:
    """A step's forwards and backwards: the gradient of the rank's mean loss (all-reduced once under DDP, at the
    last micro-batch), and that loss and its parts, on the device, unwaited. Each micro-batch's loss is weighted by
    its share of the rank's samples: after DDP's average, the global batch's mean gradient, whatever the split."""
    ctx.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(1 + len(ctx.parts), device=ctx.input.device)
    for j, (batch, part) in enumerate(zip(micro_batches, slices)):
        images, targets = prepare_batch(batch.images, batch.labels, ctx.input)
        if ctx.mixer is not None:
            images, targets = ctx.mixer(images, targets, seed, step, part.start, ctx.input.channels_last)
        # model-side randomness (dropout, drop path) from (seed, step, position in the global batch): a resumed step,
        # or the same step at another world size, draws the same
        torch.manual_seed(int(np.random.SeedSequence([seed, step, part.start]).generate_state(1)[0]))
        last = j == len(micro_batches) - 1
        with contextlib.ExitStack() as stack:
            if not last and hasattr(ctx.model, "no_sync"):
                stack.enter_context(ctx.model.no_sync())
            frozen = part.start % share != 0  # not the first micro-batch of the rank's share
            if frozen:
                stack.enter_context(ctx.running_stats.frozen())
            with ctx.input.autocast():
                loss, parts = micro_batch_loss(ctx.model, ctx.criterion, ctx.distillation, images, targets)
            weighted = loss * (len(batch) / share)  # x1.0 when there is one micro-batch: exact
            if ctx.recomputes and not frozen:  # the forward updated the running statistics; the recomputation
                stack.enter_context(ctx.running_stats.frozen())  # must not again
            ctx.scaler.scale(weighted).backward()
        total += parts * (len(batch) / share)
    return total


def apply_gradients(ctx: StepContext, lr: float) -> None:
    """The optimizer's step at `lr`, on the accumulated gradient (clipped first under --clip-grad-norm)."""
    for group in ctx.optimizer.param_groups:  # --layer-decay's groups take their share of the LR, as in timm
        group["lr"] = lr * group.get("lr_scale", 1.0)  # x1.0 elsewhere: exact
    if ctx.clip_grad_norm is not None:  # on the all-reduced gradient: every rank clips the same, at any world size
        ctx.scaler.unscale_(ctx.optimizer)  # the norm of the true gradient, not of the loss-scaled one
        torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), ctx.clip_grad_norm)
    ctx.scaler.step(ctx.optimizer)
    ctx.scaler.update()


class ValidationFit(Protocol):
    """What halves validation's batches on an out-of-memory error: micro_batch.MicroBatches (which imports this
    module), in training and under --evaluate."""

    validation_batch: Optional[int]  # most images a forward pass takes; None: the whole batch, and OOM ends the run

    def validation_failed(self, size: int, error: str) -> None: ...


@torch.no_grad()
def evaluate(to: ModelInput, model: nn.Module, loader: Iterable[Batch], flip_average: bool = False,
             columns: Optional[torch.Tensor] = None, counts: Optional[Counts] = None,
             fit: Optional[ValidationFit] = None) -> EvalResult:
    """Each rank runs its shard on the *unwrapped* model (shards may differ in batch count; DDP's forward would wait
    on a collective), then sums add up across ranks. `flip_average`: logits averaged with the mirror's; `columns`:
    score only these classes (ImageNet-A/-R's 200), labels index it; `counts`: further sums; `fit`: batches cut to
    `fit.validation_batch` (None: whole, and out of memory ends the run), a piece out of memory told to `fit` (which
    halves or raises) and retried."""
    model.eval()
    extra = len(counts.names) if counts is not None else 0
    totals = torch.zeros(3 + extra, dtype=torch.float64, device=to.device)  # loss sum, top-1, top-5, counts
    samples = 0  # counted on the host: a tensor made per batch would be a blocking copy to the device
    for batch in loader:
        start = 0
        while start < len(batch):
            piece = fit.validation_batch if fit is not None else None
            stop = len(batch) if piece is None else min(len(batch), start + piece)
            try:
                totals += batch_sums(to, model, batch.part(slice(start, stop)), flip_average, columns, counts)
            except torch.OutOfMemoryError as error:
                if piece is None:
                    raise
                fit.validation_failed(stop - start, one_line(error))
                continue
            start = stop
        samples += len(batch)
    totals = torch.cat([totals, torch.tensor([float(samples)], dtype=torch.float64).to(to.device)])
    distributed.all_reduce_sum(totals)
    loss_sum, top1, top5, *others, samples = totals.tolist()
    count = max(samples, 1.0)
    return EvalResult(loss=loss_sum / count, top1=100 * top1 / count, top5=100 * top5 / count, samples=int(samples),
                      counts=dict(zip(counts.names, others)) if counts is not None else {})


def batch_sums(to: ModelInput, model: nn.Module, batch: Batch, flip_average: bool, columns: Optional[torch.Tensor],
               counts: Optional[Counts]) -> torch.Tensor:
    """One batch's loss sum, top-1 and top-5 counts and `counts`' sums, as float64 on the device."""
    images, labels = prepare_batch(batch.images, batch.labels, to)
    with to.autocast():
        logits = model(images).float()
        if flip_average:
            logits = (logits + model(images.flip(3)).float()) / 2
    if columns is not None:
        logits = logits.index_select(1, columns)
    loss = F.cross_entropy(logits, labels, reduction="sum")
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices.eq(labels[:, None])
    sums = [loss.double(), top[:, 0].sum().double(), top.any(dim=1).sum().double()]
    if counts is not None:
        sums.extend(counts.count(logits, batch).to(torch.float64).unbind())
    return torch.stack(sums)
