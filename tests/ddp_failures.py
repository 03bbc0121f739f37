"""An out-of-memory error injected into one rank's step of --micro-batch auto under DDP, and the tiny model and
step context it fails in (test_micro_batch_ddp.py across processes, test_ddp_ledger.py on one rank)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.train.micro_batch import MicroBatches
from imagenet_elastic.train.step import StepContext

FAILING_STEP = 2  # the step that fails, unless a test names another


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5))


def context(net: nn.Module) -> StepContext:
    # tiny buckets: several all-reduces in the backward, so that one can fail between two of them
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.0005)
    return StepContext(ddp, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                       torch.amp.GradScaler("cpu", enabled=False), nn.CrossEntropyLoss(),
                       ModelInput(torch.device("cpu"), None, False))


class Failure:
    """An out-of-memory error on `failing_rank`, once, at `failing_step`: `where` says at which point of the step
    (tests/train/test_ddp_ledger.py's one rank fails so too)."""

    def __init__(self, where: str, ctx: StepContext, rank: int, failing_rank: int = 1,
                 failing_step: int = FAILING_STEP) -> None:
        self.where, self.rank, self.step, self.calls, self.armed = where, rank, -1, 0, True
        self.failing_rank, self.failing_step = failing_rank, failing_step
        self.micro = None
        self.launched = None  # gradient buckets this rank had all-reduced when the backward failed
        ddp = ctx.model
        if where == "decoding the step's batch":
            pass  # told by `before`, as data/device/feed.py tells the decoder's error before the step taking it
        elif where == "before DDP's forward":
            ddp.register_forward_pre_hook(self.raise_in_forward)
        elif where == "in the second micro-batch's forward":
            ddp.module[3].register_forward_pre_hook(self.raise_in_forward)
        else:  # when the first layer's gradient is computed, after the later layers': their buckets are under way
            ddp.module[0].register_forward_hook(
                lambda module, args, output: self.watch_backward(output, ddp.require_backward_grad_sync))

    def due(self) -> bool:
        return self.armed and self.rank == self.failing_rank and self.step == self.failing_step

    def raise_in_forward(self, module, args) -> None:
        self.calls += 1
        if self.due() and (self.where == "before DDP's forward" or self.calls % 2 == 0):
            self.armed = False
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    def watch_backward(self, output: torch.Tensor, synchronising: bool) -> None:
        if synchronising and self.due():
            output.register_hook(self.raise_in_backward)

    def raise_in_backward(self, grad: torch.Tensor) -> None:
        self.armed = False
        self.launched = self.micro.ledger.launched
        raise torch.OutOfMemoryError("CUDA out of memory (injected, in the backward)")

    def before(self, step: int, micro: MicroBatches) -> None:
        self.step, self.micro = step, micro
        if self.where == "decoding the step's batch" and self.due():
            self.armed = False
            micro.decode_failed("training", f"decoding a batch of 4 images for training step {step + 1}",
                                "CUDA out of memory (injected, decoding)", again=False)
