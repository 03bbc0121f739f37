"""batch_crops: a batch of differently sized images cropped, resized and flipped in a fixed number of operators, with
the pixels of the per-image float resize (PyTorch's antialiased weights) and of torchvision's validation view."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from device_ops import OpCounter
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from imagenet_elastic.data import pixels
from imagenet_elastic.data.device import batch_crops

SHAPES = [(90, 70), (64, 120), (33, 33), (200, 150), (48, 40), (375, 500), (12, 300)]  # (height, width)


def images(seed: int = 1, shapes=SHAPES) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)) for h, w in shapes]


def train_views(decoded: list[torch.Tensor], size: int, seed: int = 0):
    rng = random.Random(seed)
    boxes = [pixels.random_resized_crop_box(im.shape[2], im.shape[1], rng) for im in decoded]
    flips = [rng.random() < 0.5 for _ in decoded]
    views = torch.tensor([batch_crops.train_view(box, flip, im.shape[2], im.shape[1], size)
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
    out = batch_crops.crop_resize(decoded, views, size)
    assert out.shape == (len(decoded), size, size, 3) and out.dtype == torch.uint8 and out.is_contiguous()
    assert_rounding_apart(out, torch.stack([float_crop(im, b, f, size) for im, b, f in zip(decoded, boxes, flips)]))
    assert any(flips) and not all(flips)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_validation_views_are_torchvisions_resize_of_the_short_side_then_its_centre_crop(interpolation):
    decoded = images(2)
    view = pixels.CentreCrop(24, 27, interpolation)
    views = torch.tensor([batch_crops.centre_view(view, im.shape[2], im.shape[1]) for im in decoded],
                         dtype=torch.float32)
    out = batch_crops.crop_resize(decoded, views, 24, interpolation)
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
    weights = batch_crops.axis_weights(axis, full, length, interpolation)[0]
    torch.testing.assert_close(weights, expected, rtol=0, atol=2e-6)


def test_a_crop_inside_a_larger_canvas_weighs_only_its_own_pixels():
    axis = torch.tensor([[30, 40, 10, 0]], dtype=torch.float32)  # pixels 30..69 of 100, to 10
    weights = batch_crops.axis_weights(axis, 10, 100, "bilinear")[0]
    assert weights[:, :30].abs().sum() == 0 and weights[:, 70:].abs().sum() == 0
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(10))


def test_a_batch_too_large_for_one_canvas_is_resized_in_parts_to_the_same_pixels(monkeypatch):
    decoded = images(3)
    _, _, views = train_views(decoded, 32)
    whole = batch_crops.crop_resize(decoded, views, 32)
    monkeypatch.setattr(batch_crops, "CANVAS_BUDGET", 3 * 200 * 200)
    assert len(batch_crops.canvas_parts([tuple(im.shape[-2:]) for im in decoded], 3 * 200 * 200)) > 2
    assert torch.equal(batch_crops.crop_resize(decoded, views, 32), whole)


def test_canvas_parts_keep_each_run_within_the_budget_and_a_huge_image_alone():
    assert batch_crops.canvas_parts([(500, 500)] * 10, budget=3 * 500 * 500 * 4) == [slice(0, 4), slice(4, 8),
                                                                                        slice(8, 10)]
    assert batch_crops.canvas_parts([(10, 10), (4000, 3000), (10, 10)], budget=3 * 4000 * 3000) == [
        slice(0, 1), slice(1, 2), slice(2, 3)]
    assert batch_crops.canvas_parts([(375, 500)] * 256) == [slice(0, 256)]  # ImageNet's batch: one canvas


def test_the_crops_of_32_images_take_as_many_operators_as_those_of_4():
    counts = []
    for count in (4, 32):
        decoded = images(4, [SHAPES[k % len(SHAPES)] for k in range(count)])
        _, _, views = train_views(decoded, 16)
        with OpCounter() as counter:
            batch_crops.crop_resize(decoded, views, 16)
        counts.append(counter.count)
    assert counts[0] == counts[1], counts


FAR_APART = [(1200, 1600), (12, 9), (40, 500), (700, 30), (1, 1), (2, 3), (333, 444)]  # the last one small


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_images_of_very_different_sizes_are_cropped_as_each_alone(interpolation):
    """Past each image's edge the canvas repeats that edge instead of zeros: the weights there are zero, so a small
    image beside a large one has the crops it has alone, where its canvas is itself."""
    decoded = images(5, FAR_APART)
    _, _, views = train_views(decoded, 24, seed=5)
    together = batch_crops.crop_resize(decoded, views, 24, interpolation)
    alone = [batch_crops.crop_resize([image], views[i:i + 1], 24, interpolation) for i, image in enumerate(decoded)]
    assert torch.equal(together, torch.cat(alone))


def layouts(image: torch.Tensor) -> dict[str, torch.Tensor]:
    """One C x H x W image over memory in other orders (nvImageCodec's H x W x C, and H x C x W), and as a view with
    gaps (a crop of a larger image)."""
    larger = torch.zeros((3, image.shape[1] + 2, image.shape[2] + 5), dtype=torch.uint8)
    larger[:, 1:-1, 3:-2] = image
    return {"hwc": image.permute(1, 2, 0).contiguous().permute(2, 0, 1),
            "hcw": image.permute(1, 0, 2).contiguous().permute(1, 0, 2), "gaps": larger[:, 1:-1, 3:-2]}


@pytest.mark.parametrize("layout", ["hwc", "hcw", "gaps"])
def test_an_image_in_any_layout_has_the_crops_of_its_c_h_w_copy(layout):
    decoded = images(6)
    _, _, views = train_views(decoded, 32, seed=6)
    other = [layouts(image)[layout] for image in decoded]
    assert not any(image.is_contiguous() for image in other)
    assert torch.equal(batch_crops.crop_resize(other, views, 32), batch_crops.crop_resize(decoded, views, 32))


def kernel_ops(decoded: list[torch.Tensor], views: torch.Tensor, size: int) -> int:
    """The operators the profiler saw the crops dispatch, those inside others included, views apart (they launch
    nothing)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        batch_crops.crop_resize(decoded, views, size)
    names = [event.name.split("::")[1] for event in profile.events() if event.name.startswith("aten::")]
    return sum(1 for name in names if not any(getattr(getattr(torch.ops.aten, name), overload).is_view
                                              for overload in getattr(torch.ops.aten, name).overloads()))


def test_the_canvas_copies_no_image_on_its_own_whatever_their_count_or_layout():
    """A nested tensor copied each image in an operator of its own, and an H x W x C one twice (made contiguous
    first): a kernel per image on a GPU. Counted inside the operators, as the profiler sees them."""
    counts = {}
    for count, layout in ((4, "chw"), (32, "chw"), (32, "hwc")):
        decoded = images(7, [SHAPES[k % len(SHAPES)] for k in range(count)])
        decoded = decoded if layout == "chw" else [layouts(image)["hwc"] for image in decoded]
        _, _, views = train_views(decoded, 16)
        counts[count, layout] = kernel_ops(decoded, views, 16)
    assert len(set(counts.values())) == 1, counts


class IndexTypes(TorchDispatchMode):
    """The dtypes of the positions index_select gathers by."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_select.default:
            self.seen.append(args[2].dtype)
        return func(*args, **(kwargs or {}))


def test_the_canvas_positions_are_int32_unless_the_batch_holds_more_bytes_and_int64_gives_the_same_canvas(
        monkeypatch):
    decoded = images(8)
    height, width = max(im.shape[1] for im in decoded), max(im.shape[2] for im in decoded)
    with IndexTypes() as int32:
        canvas = batch_crops.padded_canvas(decoded, height, width)
    monkeypatch.setattr(batch_crops, "INT32_POSITIONS", sum(im.numel() for im in decoded) - 1)
    with IndexTypes() as int64:
        assert torch.equal(batch_crops.padded_canvas(decoded, height, width), canvas)
    assert int32.seen == [torch.int32] and int64.seen == [torch.int64]
    for i, image in enumerate(decoded):
        assert torch.equal(canvas[i, :, :image.shape[1], :image.shape[2]], image.float())
