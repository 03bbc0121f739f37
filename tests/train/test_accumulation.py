"""Gradient accumulation: a global batch in micro-batches trains like the same batch in one piece."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from imagenet_elastic.data.device.feed import step_groups
from imagenet_elastic.data.model_input import ModelInput, prepare_batch
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.train.step import StepContext, train_step


def make_ctx(seed: int = 0) -> StepContext:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 3, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return StepContext(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), nn.CrossEntropyLoss(),
                       ModelInput(torch.device("cpu"), None, False))


def batch(n: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randint(0, 256, (n, 4, 4, 3), dtype=torch.uint8, generator=g),
                 torch.randint(0, 5, (n,), generator=g), torch.arange(n))


def split(full: Batch, slices: list[slice]) -> list[Batch]:
    return [Batch(full.images[s], full.labels[s], full.indices[s]) for s in slices]


@pytest.mark.parametrize("global_batch,micro", [(16, 8), (16, 5), (12, 4), (13, 4)])
def test_accumulated_step_matches_one_big_step(global_batch, micro):
    """Model with dropout: masks come from (seed, step, position), so they differ between the two
    layouts; dropout is switched off here to compare gradients, and tested on its own below."""
    whole, parts = make_ctx(), make_ctx()
    whole.model[3].p = parts.model[3].p = 0.0
    one = BatchPlan(global_batch, 1, global_batch)
    many = BatchPlan(global_batch, 1, micro)
    for step in range(3):
        data = batch(global_batch, step)
        loss_whole = train_step(whole, [data], one.micro_slices(0), one.share, 0.1, 0, step)
        loss_parts = train_step(parts, split(data, many.micro_slices(0)), many.micro_slices(0), many.share, 0.1, 0,
                                step)
        assert loss_parts.item() == pytest.approx(loss_whole.item(), rel=1e-6)
    for a, b in zip(whole.model.parameters(), parts.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dropout_masks_depend_on_step_and_position_not_on_the_process():
    """The same step and micro-batch position give the same dropout mask, so a resumed step is exact."""
    first, second = make_ctx(), make_ctx()
    plan = BatchPlan(8, 1, 8)
    data = batch(8, 0)
    torch.manual_seed(123)  # whatever state the global generator was left in
    a = train_step(first, [data], plan.micro_slices(0), plan.share, 0.1, seed=5, step=7)
    b = train_step(second, [data], plan.micro_slices(0), plan.share, 0.1, seed=5, step=7)
    assert torch.equal(a, b)
    for p, q in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q)
    c = train_step(make_ctx(), [data], plan.micro_slices(0), plan.share, 0.1, seed=5, step=8)
    assert not torch.equal(a, c)


def test_step_groups_hands_out_whole_steps_only():
    assert list(step_groups(range(7), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(step_groups(range(4), 1)) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("micro", [8, 3])
def test_clip_grad_norm_scales_the_global_batchs_gradient_down_to_the_bound(micro):
    """The first SGD step moves each weight by -lr x gradient: clipped, by the same direction scaled to the bound;
    over micro-batches, the bound applies to their accumulated gradient. A loose bound changes no bit."""
    plan = BatchPlan(8, 1, micro)
    data = batch(8, 0)
    steps = {}
    for bound in (None, 0.01, 1e6):
        ctx = make_ctx()
        ctx.model[3].p = 0.0
        ctx.clip_grad_norm = bound
        before = [p.detach().clone() for p in ctx.model.parameters()]
        train_step(ctx, split(data, plan.micro_slices(0)), plan.micro_slices(0), plan.share, 0.1, 0, 0)
        steps[bound] = [p.detach() - b for p, b in zip(ctx.model.parameters(), before)]
    gradient_norm = torch.cat([d.flatten() for d in steps[None]]).norm() / 0.1
    assert gradient_norm > 0.01 * 10  # the tight bound really clips
    for plain, clipped in zip(steps[None], steps[0.01]):  # differences of float32 weights: a few ulps apart
        torch.testing.assert_close(clipped, plain * (0.01 / gradient_norm), rtol=1e-4, atol=3e-8)
    assert all(torch.equal(a, b) for a, b in zip(steps[None], steps[1e6]))


def test_batch_norm_statistics_and_counter_come_from_the_first_micro_batch_only():
    """Accumulating 3 micro-batches: running mean and variance are exactly those one forward pass of the first
    micro-batch leaves (the others normalise with their own statistics but update nothing), and the batch
    counter counts the optimizer step once, so every world size and split keeps the same buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(5))
    model(torch.zeros(2, 3, 4, 4))
    model.train()
    ctx = StepContext(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      torch.amp.GradScaler("cpu", enabled=False), nn.CrossEntropyLoss(),
                      ModelInput(torch.device("cpu"), None, False))
    norm = model[1]
    norm.running_mean.normal_()  # not the initial zeros and ones: an update of either would show
    norm.running_var.uniform_(0.5, 2.0)
    norm.num_batches_tracked.fill_(7)
    plan = BatchPlan(12, 1, 4)
    data = batch(12, 3)
    parts = split(data, plan.micro_slices(0))
    first_only = copy.deepcopy(model)
    with torch.no_grad():
        first_only(prepare_batch(parts[0].images, parts[0].labels, ctx.input)[0])
    train_step(ctx, parts, plan.micro_slices(0), plan.share, 0.1, 0, 0)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(norm, name), getattr(first_only[1], name)), name
    assert int(norm.num_batches_tracked) == 8 and norm.momentum == 0.1  # and the momentum is back
