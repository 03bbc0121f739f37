"""batch_policy: a batch's policy and erasing, drawn by the workers (Augment.draws) and applied once per operation to
the sub-batch that drew it, are torchvision's tensor kernels image by image, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from device_ops import OpCounter

from imagenet_elastic.data.augment import MEAN_PIXEL, POLICIES, Augment, Draws
from imagenet_elastic.data.device import batch_policy

SIZE = 40


def crops(count: int, seed: int = 0) -> torch.Tensor:
    """Noise with grey patches (the colour operations' blends hit exact integers there) and a saturated corner."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 256, (count, SIZE, SIZE, 3), dtype=np.uint8)
    out[:, :10, :10] = out[:, :10, :10, :1]
    out[:, -6:, -6:] = 255
    return torch.from_numpy(out)


def seeds(count: int, seed: int = 0) -> list[int]:
    return [int(s) for s in np.random.default_rng(seed + 100).integers(0, 2 ** 62, count)]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_batched_policy_and_erasing_are_torchvisions_kernels_image_by_image(policy):
    augment = Augment(policy=policy, erase=0.5)
    images, drawn = crops(160), seeds(160)
    plan = batch_policy.PolicyPlan.pack([augment.draws(s, SIZE) for s in drawn], SIZE)
    before = torch.get_rng_state()
    out = plan.apply(images.clone())
    assert torch.equal(torch.get_rng_state(), before)  # nothing drawn where the batch is augmented
    assert torch.equal(out, torch.stack([augment.apply(im, s, pil=False) for im, s in zip(images, drawn)]))
    assert not torch.equal(out, images)


def test_the_policies_draw_every_operation_the_device_knows():
    drawn = {op for policy in ("ta_wide", "ra", "imagenet") for s in seeds(300)
             for op, _ in Augment(policy=policy).draws(s, SIZE).ops}
    assert drawn == set(batch_policy.OPS)


def test_draws_leave_the_global_generator_alone_and_are_none_without_a_second_pass():
    augment = Augment(policy="ra", erase=1.0)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    draws = augment.draws(12345, SIZE)
    assert torch.equal(torch.rand(4), expected)
    assert len(draws.ops) == 2 and draws.erase is not None  # RandAugment's two operations; p=1 erasing
    assert draws == augment.draws(12345, SIZE) and draws != augment.draws(12346, SIZE)
    assert Augment().draws(Augment().draw_seed(__import__("random").Random(0)), SIZE) is None


def test_a_plan_groups_each_stage_by_operation_and_needs_no_device_value_on_the_host():
    draws = [Draws((("Invert", 0.0), ("Solarize", 0.5))), Draws((("Brightness", 0.2),)), None,
             Draws((("Invert", 0.0),), erase=(1, 2, 3, 4))]
    plan = batch_policy.PolicyPlan.pack(draws, SIZE)
    code = batch_policy.CODE
    assert plan.order.tolist() == [[2, 1, 0, 3], [1, 2, 3, 0]]  # by operation, Identity first, stable
    assert plan.counts[0][code["Identity"]] == 1 and plan.counts[0][code["Invert"]] == 2
    assert plan.counts[1][code["Identity"]] == 3 and plan.counts[1][code["Solarize"]] == 1
    assert plan.numbers[1, 0, batch_policy.FACTOR] == pytest.approx(1.2)
    assert plan.numbers[0, 1, batch_policy.THRESHOLD] == pytest.approx(127.5)
    assert plan.erase.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 2, 3, 4]]
    assert batch_policy.PolicyPlan.pack([None, None], SIZE) is None


def test_erasing_sets_each_drawn_box_to_the_mean_pixel_and_leaves_the_rest():
    images = crops(3)
    plan = batch_policy.PolicyPlan.pack([Draws(erase=(2, 5, 7, 3)), Draws(), Draws(erase=(0, 0, SIZE, 1))], SIZE)
    out = plan.apply(images.clone())
    mean = torch.tensor(MEAN_PIXEL, dtype=torch.uint8)
    assert (out[0, 2:9, 5:8] == mean).all() and torch.equal(out[1], images[1])
    assert (out[2, :, 0] == mean).all() and torch.equal(out[2, :, 1:], images[2, :, 1:])
    outside = out[0].clone()
    outside[2:9, 5:8] = images[0, 2:9, 5:8]
    assert torch.equal(outside, images[0])


def test_the_policy_on_160_images_takes_no_more_operators_than_on_40():
    augment = Augment(policy="ta_wide", erase=0.5)
    counts = []
    for count in (40, 160):
        plan = batch_policy.PolicyPlan.pack([augment.draws(s, SIZE) for s in seeds(count)], SIZE)
        with OpCounter() as counter:
            plan.apply(crops(count))
        counts.append(counter.count)
    assert counts[1] <= 1.1 * counts[0], counts
