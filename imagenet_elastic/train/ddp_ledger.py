"""What a rank owes the others under DDP when its step failed part-way (an out-of-memory error), so that no rank
waits forever in a collective the failed one never joins, and all redo the step.

It made a prefix of the step's collectives (the buffers' broadcast before the first forward, one all-reduce per
gradient bucket in the last backward; `entered` and `launched` mark where it stopped), and `settle` makes the rest with
zero gradients, as DDP's join mode does. A backward that raised leaves the reducer refusing the next iteration: `reset`
(DDP's `_reset_state`) restarts it on every rank, which rebuild buckets alike; zeros never reach an optimizer. Private
DDP parts used (torch >= 2.3): `_pre_forward`, the reducer's `_get_zeros_like_grad_buckets` and `_run_comm_hook`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class CollectiveLedger:
    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp
        self.entered = False
        self.launched = 0
        self.scale = 1.0 / dist.get_world_size(ddp.process_group)
        ddp.register_comm_hook(self, count_and_all_reduce)
        ddp.module.register_forward_pre_hook(self.enter)

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        self.entered = True

    def start(self) -> None:
        """A new attempt at a step."""
        self.entered, self.launched = False, 0

    def settle(self) -> None:
        """After a failed attempt: the collectives this rank still owes (the forward's, zero buckets'), awaited."""
        if not self.entered:
            self.ddp._pre_forward()
        reducer = self.ddp.reducer
        pending = [reducer._run_comm_hook(bucket) for bucket in reducer._get_zeros_like_grad_buckets()[self.launched:]]
        for work in pending:
            work.wait()

    def reset(self) -> None:
        """Before the redo, on every rank: the reducer back at an iteration's start, the buffers broadcast again."""
        self.ddp.reducer._reset_state()
        self.ddp.require_forward_param_sync = True


def count_and_all_reduce(ledger, bucket):  # type: ignore[no-untyped-def]
    """DDP's default reduction (the mean over ranks) of one bucket, counted: the bucket times the 1/world-size float
    DDP applies while filling it, so the same bits. (No annotations: DDP checks them; ours are strings.)"""
    ledger.launched += 1
    work = dist.all_reduce(bucket.buffer().mul_(ledger.scale), group=ledger.ddp.process_group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])
