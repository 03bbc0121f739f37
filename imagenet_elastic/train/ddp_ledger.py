"""What a rank owes the others under DDP when its step failed part-way (an out-of-memory error), so that no rank
waits forever in a collective the failed one never joins, and the step can be redone by all.

A step's collectives under DDP, on every rank, in this order: before the first micro-batch's forward, the
buffers' broadcast from rank 0 (and, once in a run, the rebuild of the gradient buckets); in the last
micro-batch's backward, one all-reduce per gradient bucket, launched in the buckets' order as their gradients
become ready. A rank that fails anywhere in the step has made a prefix of these. The others go on and make them
all: under gloo their backward blocks in the first all-reduce the failed rank did not join; under NCCL their GPU
does. So the failed rank makes the rest, with zeros for its gradients (`settle`), as DDP's own join mode does
for a rank that ran out of data; the ledger knows where the prefix ended:

- `entered`: the wrapped module's forward began, so DDP's collectives before it were made (a forward pre-hook);
- `launched`: the gradient buckets this rank all-reduced in this attempt (a communication hook that counts, then
  does what DDP's default one does: divide by the world size, sum).

A backward that raised leaves the reducer expecting the rest of its hooks, and refusing the next iteration.
`reset` (DDP's own `_reset_state`, which its `_update_process_group` uses) puts it back to the start of an
iteration; every rank resets, so that all rebuild their buckets at the same later forward, as the first
iteration did. Every rank's gradients are then dropped and the step redone: zeros never reach an optimizer.

Private parts of DDP used here (torch >= 2.3; join mode and `_update_process_group` rely on them):
`_pre_forward`, `reducer._get_zeros_like_grad_buckets`, `reducer._run_comm_hook`, `reducer._reset_state`.
"""

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
        """After this rank's attempt failed: the step's collectives it has not made yet, the forward's (if it
        never got into the module) and its gradient buckets' all-reduces (of zeros), each waited for."""
        if not self.entered:
            self.ddp._pre_forward()
        reducer = self.ddp.reducer
        pending = [reducer._run_comm_hook(bucket) for bucket in reducer._get_zeros_like_grad_buckets()[self.launched:]]
        for work in pending:
            work.wait()

    def reset(self) -> None:
        """Every rank, before the step is redone: the reducer at the start of an iteration, and the redone first
        forward broadcasting the buffers again, on every rank alike."""
        self.ddp.reducer._reset_state()
        self.ddp.require_forward_param_sync = True


def count_and_all_reduce(ledger, bucket):  # type: ignore[no-untyped-def]
    """DDP's default reduction (the mean over ranks) of one bucket (a dist.GradBucket), counted. DDP's own path
    multiplies by 1/world-size while it copies the gradients into the bucket; this multiplies the bucket by the same
    float, so the sums are the same bits. (No annotations: DDP checks them, and this module's are strings.)"""
    ledger.launched += 1
    tensor = bucket.buffer().mul_(ledger.scale)
    work = dist.all_reduce(tensor, group=ledger.ddp.process_group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])
