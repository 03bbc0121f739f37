"""--mixup-alpha and --cutmix-alpha: pairs (2k, 2k+1) of the global batch, mixed by draws of (seed, step)
alone, so any split of the batch over ranks and micro-batches mixes every image the same way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.errors import UserError
from imagenet_elastic.train.mixing import Mixer, check_pairs, cut_boxes

CLASSES = 10


def global_batch(n: int = 16, size: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def mixed_in_parts(mixer: Mixer, images, labels, sizes: list[int], seed: int = 1, step: int = 5):
    out, targets, start = [], [], 0
    for size in sizes:
        x, t = mixer(images[start:start + size], labels[start:start + size], seed, step, start)
        out.append(x)
        targets.append(t)
        start += size
    return torch.cat(out), torch.cat(targets)


@pytest.mark.parametrize(("mixup", "cutmix"), [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_every_split_of_the_global_batch_mixes_each_image_the_same_bits(mixup, cutmix):
    mixer = Mixer(mixup, cutmix, CLASSES)
    images, labels = global_batch()
    whole = mixed_in_parts(mixer, images, labels, [16])
    for sizes in ([8, 8], [4, 4, 4, 4], [2] * 8, [6, 4, 6]):  # ranks x micro-batches, any even split
        parts = mixed_in_parts(mixer, images, labels, sizes)
        assert torch.equal(parts[0], whole[0]) and torch.equal(parts[1], whole[1]), sizes


def test_draws_are_a_function_of_seed_and_step_and_a_prefix_of_one_stream():
    mixer = Mixer(0.2, 1.0, CLASSES)
    long, short = mixer.draws(3, 7, 100), mixer.draws(3, 7, 8)
    for name in ("lam", "cut", "centre_y", "centre_x"):
        assert np.array_equal(getattr(long, name)[:8], getattr(short, name)), name
        assert np.array_equal(getattr(mixer.draws(3, 7, 8), name), getattr(short, name))
    assert not np.array_equal(mixer.draws(3, 8, 8).lam, short.lam)  # another step
    assert not np.array_equal(mixer.draws(4, 7, 8).lam, short.lam)  # another seed
    assert 0.3 < long.cut.mean() < 0.7  # both on: each pair takes one of the two, half each


def test_mixup_averages_each_pair_and_its_labels_with_one_weight():
    images, labels = global_batch(8)
    mixer = Mixer(0.4, 0.0, CLASSES)
    mixed, targets = mixer(images, labels, 0, 0, 0)
    lam = mixer.draws(0, 0, 4).lam
    onehot = F.one_hot(labels, CLASSES).float()
    for k in range(4):
        a, b, w = 2 * k, 2 * k + 1, float(np.float32(lam[k]))
        assert torch.allclose(mixed[a], w * images[a] + (1 - w) * images[b], atol=1e-6)
        assert torch.allclose(mixed[b], w * images[b] + (1 - w) * images[a], atol=1e-6)
        assert torch.allclose(targets[a], w * onehot[a] + (1 - w) * onehot[b])
    assert torch.allclose(targets.sum(1), torch.ones(8))


def test_cutmix_pastes_the_partners_box_and_weights_the_labels_by_the_area_kept():
    images, labels = global_batch(16, size=20)
    labels = torch.arange(16) % CLASSES  # partners differ, so each target names both shares
    mixed, targets = Mixer(0.0, 1.0, CLASSES)(images, labels, 2, 9, 0)
    partner = torch.arange(16) ^ 1
    own = (mixed == images).all(1)  # per pixel: the image's own, or else exactly its partner's
    assert ((mixed == images[partner]).all(1) | own).all()
    kept = own.float().mean((1, 2))
    assert torch.allclose(targets[torch.arange(16), labels], kept, atol=1e-6)
    assert torch.allclose(targets[torch.arange(16), labels[partner]], 1 - kept, atol=1e-6)
    assert (kept < 1).any()  # some box was pasted


def test_cut_boxes_are_clipped_to_the_image():
    top, bottom, left, right = cut_boxes(np.array([0.0, 0.5, 0.99]), np.array([0.0, 0.5, 0.99]),
                                         np.array([0.99, 0.5, 0.0]), 10, 20)
    assert (top >= 0).all() and (bottom <= 10).all() and (left >= 0).all() and (right <= 20).all()
    assert (top[0], bottom[0], left[0], right[0]) == (0, 5, 9, 20)  # a whole-image box centred in a corner


def test_channels_last_in_channels_last_out():
    images, labels = global_batch(4)
    mixed, _ = Mixer(0.2, 1.0, CLASSES)(images.contiguous(memory_format=torch.channels_last), labels, 0, 0, 0,
                                        channels_last=True)
    assert mixed.is_contiguous(memory_format=torch.channels_last)


def test_micro_batches_that_split_a_pair_are_refused_naming_the_flags():
    plan = BatchPlan(global_batch=12, world_size=2, micro_batch=4)  # shares of 6 in micro-batches of 3
    with pytest.raises(UserError, match="--mixup-alpha/--cutmix-alpha .* rank 0 micro-batches of 3/3"):
        check_pairs(plan)
    check_pairs(BatchPlan(global_batch=16, world_size=2, micro_batch=4))
