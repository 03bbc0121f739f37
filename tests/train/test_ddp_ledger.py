"""The DDP ledger (train/ddp_ledger.py) in this process, on a one-rank gloo group: a step of --micro-batch auto that
runs out of memory before DDP's forward, inside a micro-batch's forward or in the middle of the synchronising backward
makes on this rank exactly the collectives of a whole step (the buffers' broadcast, an all-reduce per gradient bucket,
in DDP's order) before it is redone; the redone step makes them again and trains as a step that never failed; the
ledger's hook counts each bucket and sums it times the ledger's scale. What only several ranks show (no rank left
waiting, the scale being 1/world size) is tests/system/test_micro_batch_ddp.py's, across processes."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from ddp_failures import Failure, context, model
from torch.nn.parallel import DistributedDataParallel

from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.train import ddp_ledger
from imagenet_elastic.train.micro_batch import MicroBatches
from imagenet_elastic.train.step import StepContext

STEPS, FAILING_STEP, SHARE, LOADER_MICRO = 3, 1, 8, 4  # two micro-batches of 4, then four of 2


@pytest.fixture
def one_rank(tmp_path):
    """The default process group: gloo, one rank, in this process."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # DDP's reducer holds the group: gone before it, or gloo's threads may hang at exit
        dist.destroy_process_group()


def batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(100 + step)
    return Batch(torch.randint(0, 256, (SHARE, 6, 6, 3), dtype=torch.uint8, generator=g),
                 torch.randint(0, 5, (SHARE,), generator=g), torch.arange(SHARE))


def train(micro: dict[int, MicroBatches], ctx: StepContext, before=None) -> None:
    """STEPS steps, each through micro[step] (or micro[-1]) as the loader cuts it into micro-batches of 4."""
    loader = BatchPlan(SHARE, 1, LOADER_MICRO)
    for step in range(STEPS):
        if before is not None:
            before(step, micro.get(step, micro[-1]))
        data = batch(step)
        micro.get(step, micro[-1]).step(ctx, [data.part(p) for p in loader.micro_slices(0)], 0.1, 0, step)


class Collectives:
    """What each attempt at a step makes on this rank, in order: `broadcast` (DDP's buffers from rank 0, before a
    forward) and `all-reduce` (a gradient bucket's, through the ledger's hook)."""

    def __init__(self, ddp: DistributedDataParallel, monkeypatch) -> None:
        self.attempts: list[list[str]] = []
        broadcast, start, reduce = ddp._sync_buffers, ddp_ledger.CollectiveLedger.start, ddp_ledger.count_and_all_reduce

        def sync_buffers() -> None:
            self.attempts[-1].append("broadcast")
            broadcast()

        def started(ledger) -> None:
            self.attempts.append([])
            start(ledger)

        def all_reduce(ledger, bucket):
            self.attempts[-1].append("all-reduce")
            return reduce(ledger, bucket)
        ddp._sync_buffers = sync_buffers
        monkeypatch.setattr(ddp_ledger.CollectiveLedger, "start", started)
        monkeypatch.setattr(ddp_ledger, "count_and_all_reduce", all_reduce)  # before a ledger registers it


WHERE = ("before DDP's forward", "in the second micro-batch's forward", "in the synchronising backward")


@pytest.mark.parametrize("where", WHERE)
def test_a_failed_step_makes_every_collective_of_a_step_once_and_is_redone_as_a_step_that_never_failed(
        one_rank, monkeypatch, where):
    loader = BatchPlan(SHARE, 1, LOADER_MICRO)
    net = model()
    ctx = context(net)
    train({step: MicroBatches(loader, 4, 0) for step in range(FAILING_STEP)} | {-1: MicroBatches(loader, 2, 0)},
          ctx)  # the reference: micro-batches of 2 from the failing step on, no ledger
    reference = {k: v.clone() for k, v in net.state_dict().items()}
    net = model()
    ctx = context(net)
    collectives = Collectives(ctx.model, monkeypatch)
    micro = MicroBatches(loader, 4, 0, auto=True, warn=lambda line: None)
    failure = Failure(where, ctx, rank=0, failing_rank=0, failing_step=FAILING_STEP)
    train({-1: micro}, ctx, before=failure.before)
    assert not failure.armed and micro.size == 2
    buckets = len(ctx.model.reducer._get_zeros_like_grad_buckets())
    assert len(collectives.attempts) == STEPS + 1  # the failed step twice
    for attempt in collectives.attempts[1:]:  # (the first step's buckets are DDP's first ones, rebuilt after it)
        assert attempt == ["broadcast"] + ["all-reduce"] * buckets, (collectives.attempts, buckets)
    if where == "in the synchronising backward":
        assert 0 < failure.launched < buckets, (failure.launched, buckets)
    for key, value in reference.items():
        assert torch.equal(net.state_dict()[key], value), f"{key} differs from the reference"


def test_the_ledgers_hook_counts_the_bucket_and_sums_it_times_the_ledgers_scale_over_ranks(one_rank):
    """DDP's default reduction, the mean: each rank's bucket times 1/world size (the ledger's scale; 1/4 here, as
    with 4 ranks), summed over the ranks (one here)."""
    values = torch.arange(6, dtype=torch.float32)
    bucket = SimpleNamespace(buffer=lambda: values)
    ledger = SimpleNamespace(launched=2, scale=1 / 4, ddp=SimpleNamespace(process_group=dist.group.WORLD))
    reduced = ddp_ledger.count_and_all_reduce(ledger, bucket).wait()
    assert torch.equal(reduced, torch.arange(6, dtype=torch.float32) / 4) and ledger.launched == 3
