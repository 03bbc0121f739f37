"""device_crops: a batch of differently sized images cropped, resized and flipped in a fixed number of operators, with
the pixels of the per-image float resize (PyTorch's antialiased weights) and of torchvision's validation view."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from imagenet_elastic.data import device_crops, pixels
from imagenet_elastic.tools.device_ops import OpCounter

SHAPES = [(90, 70), (64, 120), (33, 33), (200, 150), (48, 40), (375, 500), (12, 300)]  # (height, width)


def images(seed: int = 1, shapes=SHAPES) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)) for h, w in shapes]


def train_views(decoded: list[torch.Tensor], size: int, seed: int = 0):
    rng = random.Random(seed)
    boxes = [pixels.random_resized_crop_box(im.shape[2], im.shape[1], rng) for im in decoded]
    flips = [rng.random() < 0.5 for _ in decoded]
    views = torch.tensor([device_crops.train_view(box, flip, im.shape[2], im.shape[1], size)
                          for box, flip, im in zip(boxes, flips, decoded)], dtype=torch.float32)
    return boxes, flips, views


def float_crop(image: torch.Tensor, box, flip: bool, size: int) -> torch.Tensor:
    crop = pixels.resize_uint8(pixels.crop_region(image.permute(1, 2, 0), box), size, uint8_kernel=False)
    crop = crop[0].permute(1, 2, 0)
    return crop.flip(1) if flip else crop


def assert_rounding_apart(a: torch.Tensor, b: torch.Tensor) -> None:
    difference = (a.int() - b.int()).abs()
    assert difference.max() <= 1 and (difference > 0).float().mean() < 1e-3, difference.max()


@pytest.mark.parametrize("size", [8, 24, 224])  # shrinking, both ways, and enlarging most crops
def test_a_batch_of_crops_is_each_images_float_resize_of_its_box_flipped_where_drawn(size):
    decoded = images()
    boxes, flips, views = train_views(decoded, size)
    out = device_crops.crop_resize(decoded, views, size)
    assert out.shape == (len(decoded), size, size, 3) and out.dtype == torch.uint8 and out.is_contiguous()
    assert_rounding_apart(out, torch.stack([float_crop(im, b, f, size) for im, b, f in zip(decoded, boxes, flips)]))
    assert any(flips) and not all(flips)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_validation_views_are_torchvisions_resize_of_the_short_side_then_its_centre_crop(interpolation):
    decoded = images(2)
    view = pixels.CentreCrop(24, 27, interpolation)
    views = torch.tensor([device_crops.centre_view(view, im.shape[2], im.shape[1]) for im in decoded],
                         dtype=torch.float32)
    out = device_crops.crop_resize(decoded, views, 24, interpolation)
    reference = []
    for image in decoded:
        resized = TF.resize(image.float(), [27], InterpolationMode(interpolation), antialias=True)
        reference.append(TF.center_crop(resized, [24]).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0))
    assert_rounding_apart(out, torch.stack(reference))


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("length,full", [(200, 24), (24, 24), (10, 24), (37, 5)])
def test_an_axis_weights_are_pytorchs_antialiased_interpolation_of_a_unit_pulse(interpolation, length, full):
    """Resizing the identity matrix along one axis gives the matrix of that resize: PyTorch's own weights."""
    pulses = torch.eye(length).view(1, 1, length, length)
    expected = F.interpolate(pulses, size=(full, length), mode=interpolation, antialias=True, align_corners=False)[0, 0]
    axis = torch.tensor([[0, length, full, 0]], dtype=torch.float32)
    weights = device_crops.axis_weights(axis, full, length, interpolation)[0]
    torch.testing.assert_close(weights, expected, rtol=0, atol=2e-6)


def test_a_crop_inside_a_larger_canvas_weighs_only_its_own_pixels():
    axis = torch.tensor([[30, 40, 10, 0]], dtype=torch.float32)  # pixels 30..69 of 100, to 10
    weights = device_crops.axis_weights(axis, 10, 100, "bilinear")[0]
    assert weights[:, :30].abs().sum() == 0 and weights[:, 70:].abs().sum() == 0
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(10))


def test_a_batch_too_large_for_one_canvas_is_resized_in_parts_to_the_same_pixels(monkeypatch):
    decoded = images(3)
    _, _, views = train_views(decoded, 32)
    whole = device_crops.crop_resize(decoded, views, 32)
    monkeypatch.setattr(device_crops, "CANVAS_BUDGET", 3 * 200 * 200)
    assert len(device_crops.canvas_parts([tuple(im.shape[-2:]) for im in decoded], 3 * 200 * 200)) > 2
    assert torch.equal(device_crops.crop_resize(decoded, views, 32), whole)


def test_canvas_parts_keep_each_run_within_the_budget_and_a_huge_image_alone():
    assert device_crops.canvas_parts([(500, 500)] * 10, budget=3 * 500 * 500 * 4) == [slice(0, 4), slice(4, 8),
                                                                                        slice(8, 10)]
    assert device_crops.canvas_parts([(10, 10), (4000, 3000), (10, 10)], budget=3 * 4000 * 3000) == [
        slice(0, 1), slice(1, 2), slice(2, 3)]
    assert device_crops.canvas_parts([(375, 500)] * 256) == [slice(0, 256)]  # ImageNet's batch: one canvas


def test_the_crops_of_32_images_take_as_many_operators_as_those_of_4():
    counts = []
    for count in (4, 32):
        decoded = images(4, [SHAPES[k % len(SHAPES)] for k in range(count)])
        _, _, views = train_views(decoded, 16)
        with OpCounter() as counter:
            device_crops.crop_resize(decoded, views, 16)
        counts.append(counter.count)
    assert counts[0] == counts[1], counts
