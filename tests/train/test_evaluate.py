"""`train/step.py evaluate`: every rank's sums over the whole validation set (its shard's and the others'), and
--val-flip-average: the logits of each image and of its mirror image, averaged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from imagenet_elastic.data.model_input import ModelInput, prepare_batch
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.launch import distributed
from imagenet_elastic.train.step import evaluate

CPU = torch.device("cpu")


def context() -> tuple[ModelInput, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(7))  # no mirror symmetry
    model(torch.zeros(1, 3, 8, 8))
    return ModelInput(CPU, None, channels_last=True), model


def batches() -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    return [Batch(torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8, generator=generator),
                  torch.randint(0, 7, (n,), generator=generator)) for n in (5, 3)]


def test_flip_average_scores_the_mean_of_each_images_and_its_mirrors_logits():
    to, model = context()
    result = evaluate(to, model, batches(), flip_average=True)
    loss = top1 = top5 = 0.0
    with torch.no_grad():
        for batch in batches():
            x, labels = prepare_batch(batch.images, batch.labels, to)
            logits = (model(x) + model(torch.flip(x, dims=[3]))) / 2
            loss += float(F.cross_entropy(logits, labels, reduction="sum"))
            top = logits.topk(5, dim=1).indices.eq(labels[:, None])
            top1, top5 = top1 + float(top[:, 0].sum()), top5 + float(top.any(dim=1).sum())
    assert result.samples == 8
    assert abs(result.loss - loss / 8) < 1e-6 * abs(loss)
    assert (result.top1, result.top5) == (100 * top1 / 8, 100 * top5 / 8)
    assert result.loss != evaluate(to, model, batches()).loss  # the mirror images change the scores here


def test_every_rank_scores_the_sums_of_all_shards_over_the_global_count(monkeypatch):
    """Shards differ in size (35 images over 2 ranks: 18 and 17); the all-reduce brings in the other rank's
    loss sum, top-1 and top-5 counts and image count, and every mean divides by the global count."""
    to, model = context()
    alone = evaluate(to, model, batches())
    other = torch.tensor([30.0, 4.0, 9.0, 12.0], dtype=torch.float64)  # another rank: loss sum, top-1, top-5, images
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda totals: totals.add_(other))
    shared = evaluate(to, model, batches())
    assert shared.samples == 8 + 12
    assert shared.loss == pytest.approx((alone.loss * 8 + 30.0) / 20, rel=1e-12)
    assert shared.top1 == pytest.approx(100 * (alone.top1 * 8 / 100 + 4) / 20, rel=1e-12)
    assert shared.top5 == pytest.approx(100 * (alone.top5 * 8 / 100 + 9) / 20, rel=1e-12)
