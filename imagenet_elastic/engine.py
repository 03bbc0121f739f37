"""One training epoch and one exact validation pass."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from imagenet_elastic import distributed
from imagenet_elastic.console import EpochProgress

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclass
class StepContext:
    """What a training or evaluation step needs besides the batch."""

    model: nn.Module  # the DDP wrapper when distributed
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    device: torch.device
    amp_dtype: Optional[torch.dtype]
    channels_last: bool

    def __post_init__(self) -> None:
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None)


@dataclass(frozen=True)
class TrainResult:
    loss: float  # mean over all ranks and steps
    steps: int
    seconds: float


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float  # percent
    top5: float  # percent
    samples: int


def prepare_batch(images: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 NHWC from the loader to normalised float NCHW on the device.

    Moving uint8 moves a quarter of the bytes of float32; the permute of NHWC data already has
    channels_last strides, so that layout costs nothing.
    """
    images = images.to(ctx.device, non_blocking=True).permute(0, 3, 1, 2).float()
    images = images.sub_(ctx.mean).div_(ctx.std)
    if not ctx.channels_last:
        images = images.contiguous()
    return images, labels.to(ctx.device, non_blocking=True)


def train_one_epoch(ctx: StepContext, loader: Iterable, lr_for_step: Callable[[int], float], first_step: int,
                    progress: EpochProgress, global_batch: int) -> TrainResult:
    """Runs the loader dry; the caller's step counter advances by the returned `steps`."""
    ctx.model.train()
    loss_sum = torch.zeros((), device=ctx.device)
    start = time.perf_counter()
    steps = 0
    for steps, (images, labels) in enumerate(loader, 1):
        lr = lr_for_step(first_step + steps - 1)
        for group in ctx.optimizer.param_groups:
            group["lr"] = lr
        images, labels = prepare_batch(images, labels, ctx)
        with ctx.autocast():
            loss = ctx.criterion(ctx.model(images), labels)
        ctx.optimizer.zero_grad(set_to_none=True)
        ctx.scaler.scale(loss).backward()
        ctx.scaler.step(ctx.optimizer)
        ctx.scaler.update()
        loss_sum += loss.detach().float()
        if progress.wants_stats(steps):  # the only host sync of the loop
            rate = steps * global_batch / (time.perf_counter() - start)
            progress.update(steps, f"loss {loss.item():.4f} lr {lr:.5f} {rate:.1f} img/s")
        else:
            progress.update(steps)
    seconds = time.perf_counter() - start
    totals = distributed.all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(steps), device=ctx.device)]))
    return TrainResult(loss=(totals[0] / totals[1].clamp(min=1)).item() if steps else float("nan"),
                       steps=steps, seconds=seconds)


@torch.no_grad()
def evaluate(ctx: StepContext, model: nn.Module, loader: Iterable) -> EvalResult:
    """Every rank runs its own shard on the *unwrapped* model (shards may differ in batch count, and
    DDP's forward would then wait on a collective), then the sums are added up across ranks."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=ctx.device)  # loss sum, top-1, top-5, samples
    for images, labels in loader:
        images, labels = prepare_batch(images, labels, ctx)
        with ctx.autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices.eq(labels[:, None])
        totals += torch.stack([loss.double(), top[:, 0].sum().double(), top.any(dim=1).sum().double(),
                               torch.tensor(float(len(labels)), dtype=torch.float64, device=ctx.device)])
    distributed.all_reduce_sum(totals)
    loss_sum, top1, top5, samples = totals.tolist()
    count = max(samples, 1.0)
    return EvalResult(loss=loss_sum / count, top1=100 * top1 / count, top5=100 * top5 / count, samples=int(samples))
