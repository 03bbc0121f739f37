"""--scale, --ratio, --hflip, --auto-augment and --random-erase: each a function of (seed, epoch, index)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from makers import make_split, write_jpeg
from PIL import Image

from imagenet_elastic.config import Config
from imagenet_elastic.data.augment import MEAN_PIXEL, POLICIES, Augment
from imagenet_elastic.data.pipeline import TrainDataset, sample_rng
from imagenet_elastic.data.pixels import random_resized_crop_box
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.errors import UserError

EVERYTHING = Augment(scale=(0.25, 1.0), ratio=(0.5, 2.0), hflip=0.3, policy="ta_wide", erase=0.5)


@pytest.fixture
def index(tmp_path):
    root = tmp_path / "train"
    make_split(root, {"cat": 3, "dog": 3}, size=(64, 48))
    return scan_image_folder(str(root), "train")


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_each_policy_is_a_function_of_the_sample_key_and_leaves_the_global_generator_alone(index, policy):
    dataset = TrainDataset(index, 32, seed=7, augment=Augment(policy=policy, erase=0.5))
    before = torch.get_rng_state()
    first = [dataset[(2, i)][0] for i in range(len(index))]
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(123)  # what else the process draws does not matter
    again = [TrainDataset(index, 32, seed=7, augment=Augment(policy=policy, erase=0.5))[(2, i)][0]
             for i in range(len(index))]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for pixels in first:
        assert pixels.dtype == torch.uint8 and pixels.shape == (32, 32, 3) and pixels.is_contiguous()
    next_epoch = [dataset[(3, i)][0] for i in range(len(index))]
    assert any(not torch.equal(a, b) for a, b in zip(first, next_epoch))


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_each_policy_changes_the_pixels_the_crop_gave(index, policy):
    plain = TrainDataset(index, 32, seed=3)
    augmented = TrainDataset(index, 32, seed=3, augment=Augment(policy=policy))
    changed = [not torch.equal(plain[(0, i)][0], augmented[(0, i)][0]) for i in range(len(index))]
    assert sum(changed) >= len(index) // 2, changed  # some ops are identities (TrivialAugmentWide's "Identity")


def test_the_crop_and_flip_are_drawn_before_and_independently_of_the_policy(index):
    """The policy's seed is drawn after the crop, so adding a policy keeps every sample's crop."""
    for i in range(len(index)):
        boxes = []
        for augment in (Augment(), Augment(policy="ra", erase=1.0)):
            seen = []

            def spy(raw, name, choose_crop, size, seen=seen):
                seen.append(choose_crop(64, 48))
                return torch.zeros(size, size, 3, dtype=torch.uint8)

            TrainDataset(index, 16, seed=1, load=spy, augment=augment)[(4, i)]
            boxes.append(seen[0])
        assert boxes[0] == boxes[1]


def test_hflip_zero_never_flips_and_one_always_flips(tmp_path):
    write_jpeg(str(tmp_path / "train" / "a" / "img.jpg"), 40, 40, seed=1)
    index = scan_image_folder(str(tmp_path / "train"), "train")
    whole = {"scale": (1.0, 1.0), "ratio": (1.0, 1.0)}  # the crop is the whole square image
    for epoch in range(6):
        never = TrainDataset(index, 40, seed=epoch, augment=Augment(hflip=0.0, **whole))[(epoch, 0)][0]
        always = TrainDataset(index, 40, seed=epoch, augment=Augment(hflip=1.0, **whole))[(epoch, 0)][0]
        assert torch.equal(always, never.flip(1))
        reference = torch.from_numpy(np.array(Image.open(index.path(0)).convert("RGB")))
        assert torch.equal(never, reference)


def test_random_erase_fills_a_rectangle_with_the_mean_pixel(tmp_path):
    black = tmp_path / "train" / "a" / "black.png"
    os.makedirs(black.parent)
    Image.fromarray(np.zeros((40, 40, 3), dtype=np.uint8)).save(black)
    index = scan_image_folder(str(tmp_path / "train"), "train")
    pixels = TrainDataset(index, 32, seed=0, augment=Augment(erase=1.0))[(0, 0)][0]
    erased = (pixels == torch.tensor(MEAN_PIXEL, dtype=torch.uint8)).all(dim=2)
    assert 0 < int(erased.sum()) < 32 * 32
    assert int((pixels[~erased] == 0).all(dim=1).sum()) == 32 * 32 - int(erased.sum())  # the rest stays black
    rows, cols = erased.nonzero(as_tuple=True)
    assert int(erased[rows.min():rows.max() + 1, cols.min():cols.max() + 1].sum()) == int(erased.sum())  # one box


@pytest.mark.parametrize(("scale", "ratio"), [((0.5, 0.5), (1.0, 1.0)), ((0.2, 0.3), (0.5, 2.0))])
def test_scale_and_ratio_bound_the_crop(scale, ratio):
    for seed in range(100):
        left, top, w, h = random_resized_crop_box(400, 300, random.Random(seed), scale, ratio)
        assert scale[0] - 0.01 <= w * h / (400 * 300) <= scale[1] + 0.01
        assert ratio[0] - 0.02 <= w / h <= ratio[1] + 0.02


def test_default_augmentation_draws_the_same_stream_as_before_these_options_existed(index):
    """Defaults keep old runs' pixels: the crop then `random() < 0.5`, and nothing else drawn."""
    for i in range(len(index)):
        seen = []

        def spy(raw, name, choose_crop, size, seen=seen):
            seen.append(choose_crop(64, 48))
            return torch.zeros(size, size, 3, dtype=torch.uint8)

        TrainDataset(index, 16, seed=2, load=spy)[(1, i)]
        rng = sample_rng(2, 1, i)
        assert seen[0] == (random_resized_crop_box(64, 48, rng), rng.random() < 0.5)


def test_everything_at_once_is_still_a_function_of_the_key(index):
    a = [TrainDataset(index, 24, seed=9, augment=EVERYTHING)[(5, i)][0] for i in range(len(index))]
    b = [TrainDataset(index, 24, seed=9, augment=EVERYTHING)[(5, i)][0] for i in reversed(range(len(index)))]
    assert all(torch.equal(x, y) for x, y in zip(a, reversed(b)))


@pytest.mark.parametrize(("changes", "message"), [
    ({"scale": (0.5, 0.1)}, "--scale: MIN must not exceed MAX, got 0.5 0.1"),
    ({"scale": (0.5, 1.5)}, "--scale: at most 1, got 1.5"),
    ({"ratio": (2.0, 1.0)}, "--ratio: MIN must not exceed MAX, got 2 1"),
])
def test_settings_that_cannot_work_are_refused_naming_the_flag(changes, message):
    with pytest.raises(UserError, match=message.replace("-", r"\-")):
        Config(data="/data", **changes)


def test_each_copy_under_repeated_augmentation_has_its_own_draws_and_the_first_is_the_plain_sample(index):
    dataset = TrainDataset(index, 32, seed=4, augment=EVERYTHING)
    plain, first, second = dataset[(1, 2)][0], dataset[(1, 2, 0)][0], dataset[(1, 2, 1)][0]
    assert torch.equal(plain, first)
    assert not torch.equal(first, second)
    assert torch.equal(second, TrainDataset(index, 32, seed=4, augment=EVERYTHING)[(1, 2, 1)][0])
