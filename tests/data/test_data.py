"""Crop geometry, per-sample randomness and datasets on real JPEGs."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from conftest import assert_names
from makers import make_split, write_jpeg
from PIL import Image

from imagenet_elastic.data.pipeline import EvalDataset, TrainDataset, sample_rng
from imagenet_elastic.data.pixels import crop_resize, decode_bytes, decoder_said, random_resized_crop_box
from imagenet_elastic.data.sources.image_folder import scan_image_folder
from imagenet_elastic.errors import CorruptImageError, UserError

SIZES = [(1, 1), (1, 2), (2, 1), (2, 3), (3, 2), (3, 3), (5, 7), (17, 3), (31, 32), (1000, 1), (1, 1000),
         (4000, 3), (3, 4000), (640, 480), (333, 500)]


# ----------------------------------------------------------------------------- crop geometry

def assert_box_inside(box, width: int, height: int) -> None:
    left, top, w, h = box
    assert w > 0 and h > 0, box
    assert left >= 0 and top >= 0, box
    assert left + w <= width and top + h <= height, (box, width, height)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_random_resized_crop_box_stays_inside_the_image(width, height):
    for seed in range(200):
        assert_box_inside(random_resized_crop_box(width, height, random.Random(seed)), width, height)


def test_random_resized_crop_box_falls_back_to_a_centre_crop_inside_the_image():
    # An area fraction no try can satisfy forces the fallback after ten tries.
    for width, height in SIZES:
        box = random_resized_crop_box(width, height, random.Random(0), scale=(5.0, 6.0))
        assert_box_inside(box, width, height)
        left, top, w, h = box
        assert left == (width - w) // 2 and top == (height - h) // 2


@pytest.mark.parametrize(("scale", "ratio"), [((0.08, 1.0), (100.0, 1000.0)), ((1e-9, 1e-9), (1e-9, 1e-9))])
def test_random_resized_crop_box_of_an_extreme_ratio_keeps_a_pixel_a_side(scale, ratio):
    for width, height in SIZES:
        assert_box_inside(random_resized_crop_box(width, height, random.Random(0), scale, ratio), width, height)


def test_random_resized_crop_box_with_the_same_seed_gives_the_same_box():
    for seed in range(20):
        first = random_resized_crop_box(640, 480, random.Random(seed))
        assert random_resized_crop_box(640, 480, random.Random(seed)) == first
    boxes = {random_resized_crop_box(640, 480, random.Random(seed)) for seed in range(20)}
    assert len(boxes) > 1


def test_random_resized_crop_box_respects_scale_and_ratio_bounds_on_large_images():
    for seed in range(200):
        _, _, w, h = random_resized_crop_box(1000, 1000, random.Random(seed))
        assert 0.08 * 1e6 * 0.97 <= w * h <= 1e6
        assert 3 / 4 * 0.97 <= w / h <= 4 / 3 * 1.03


def test_sample_rng_is_deterministic():
    assert sample_rng(1, 2, 3).random() == sample_rng(1, 2, 3).random()
    assert [sample_rng(0, 0, 0).random() for _ in range(3)] == [sample_rng(0, 0, 0).random()] * 3


def test_sample_rng_differs_in_seed_epoch_and_index():
    base = sample_rng(1, 2, 3).random()
    assert sample_rng(9, 2, 3).random() != base
    assert sample_rng(1, 9, 3).random() != base
    assert sample_rng(1, 2, 9).random() != base
    # "1:23:4" vs "12:3:4": the separator keeps neighbouring arguments apart.
    assert sample_rng(1, 23, 4).random() != sample_rng(12, 3, 4).random()


# ----------------------------------------------------------------------------- datasets

@pytest.fixture
def image_root(tmp_path):
    root = tmp_path / "train"
    make_split(root, {"cat": 2, "dog": 1})
    write_jpeg(os.path.join(root, "dog", "wide.jpg"), 120, 9, seed=99)
    return str(root)


@pytest.mark.parametrize("size", [16, 32, 64])
def test_train_dataset_returns_uint8_hwc_of_the_requested_size(image_root, size):
    dataset = TrainDataset(scan_image_folder(image_root, "train"), size=size, seed=0)
    assert len(dataset) == 4
    for i in range(len(dataset)):
        pixels, target, index = dataset[(0, i)]
        assert pixels.dtype == torch.uint8
        assert pixels.shape == (size, size, 3)
        assert target == int(dataset.source.labels[i]) and index == i


def test_train_dataset_same_key_gives_identical_pixels_across_instances(image_root):
    first = TrainDataset(scan_image_folder(image_root, "train"), size=24, seed=5)
    second = TrainDataset(scan_image_folder(image_root, "train"), size=24, seed=5)
    for i in range(len(first)):
        a, target_a, _ = first[(3, i)]
        b, target_b, _ = second[(3, i)]
        assert torch.equal(a, b)
        assert target_a == target_b


def test_train_dataset_different_epoch_gives_different_pixels(image_root):
    dataset = TrainDataset(scan_image_folder(image_root, "train"), size=24, seed=5)
    for i in range(len(dataset)):
        if dataset.source.path(i).endswith("wide.jpg"):
            continue  # 120x9: every try misses, so only the flip varies (see the next test)
        assert not torch.equal(dataset[(0, i)][0], dataset[(1, i)][0]), dataset.source.path(i)


def test_train_dataset_very_wide_image_still_varies_across_epochs_by_its_flip(image_root):
    dataset = TrainDataset(scan_image_folder(image_root, "train"), size=24, seed=5)
    wide = [dataset.source.path(i) for i in range(len(dataset))].index(os.path.join(image_root, "dog", "wide.jpg"))
    crops = [dataset[(epoch, wide)][0] for epoch in range(8)]
    assert any(not torch.equal(crops[0], crop) for crop in crops[1:])


def test_train_dataset_different_seed_gives_different_pixels(image_root):
    index = scan_image_folder(image_root, "train")
    a = TrainDataset(index, size=24, seed=0)[(0, 0)][0]
    b = TrainDataset(index, size=24, seed=1)[(0, 0)][0]
    assert not torch.equal(a, b)


def test_eval_dataset_returns_deterministic_uint8_hwc_of_the_requested_size(image_root):
    index = scan_image_folder(image_root, "val")
    first, second = EvalDataset(index, size=32, resize=36), EvalDataset(index, size=32, resize=36)
    assert len(first) == 4
    for i in range(len(first)):
        pixels, target, position = first[i]
        assert pixels.dtype == torch.uint8 and pixels.shape == (32, 32, 3)
        assert target == int(index.labels[i]) and position == i
        assert torch.equal(pixels, second[i][0])


def test_eval_dataset_resizes_the_whole_image_then_crops_its_centre_as_torchvision_does(tmp_path):
    """The long side becomes int(32 * 80 / 60) = 42, not round(42.67) = 43, and the crop starts at round((42 - 28)
    / 2) = 7: torchvision's Resize and CenterCrop, which timm's eval transform uses (tests/data/test_reference_pixels.py
    compares with timm itself)."""
    x = np.linspace(0, 255, 80, dtype=np.float32)
    y = np.linspace(0, 255, 60, dtype=np.float32)
    grad = np.stack([np.tile(x, (60, 1)), np.tile(y[:, None], (1, 80)), np.full((60, 80), 128.0)], axis=-1)
    path = tmp_path / "val" / "a" / "g.png"
    path.parent.mkdir(parents=True)
    Image.fromarray(grad.astype(np.uint8)).save(path)
    pixels = EvalDataset(scan_image_folder(str(tmp_path / "val"), "val"), size=28, resize=32)[0][0]
    resized = Image.open(path).convert("RGB").resize((42, 32), Image.BILINEAR)
    expected = np.asarray(resized.crop((7, 2, 7 + 28, 2 + 28)), dtype=np.int16)
    assert np.abs(pixels.numpy().astype(np.int16) - expected).max() <= 1


def test_corrupt_image_raises_corrupt_image_error_naming_the_file(tmp_path):
    root = tmp_path / "train"
    make_split(root, {"a": 1})
    bad = root / "a" / "broken.jpg"
    bad.write_bytes(b"\x00not an image" + np.random.default_rng(0).bytes(2000))
    index = scan_image_folder(str(root), "train")
    position = [index.path(i) for i in range(len(index))].index(str(bad))
    with pytest.raises(CorruptImageError, match="cannot decode image file") as caught:
        TrainDataset(index, size=16, seed=0)[(0, position)]
    assert str(bad) in str(caught.value)
    assert isinstance(caught.value, UserError)
    with pytest.raises(CorruptImageError) as caught:
        EvalDataset(index, size=16, resize=18)[position]
    assert str(bad) in str(caught.value)


def test_a_file_pillow_cannot_identify_is_named_by_its_path_not_by_pillows_buffer(tmp_path):
    """Pillow's own message names the in-memory buffer it was given (`<_io.BytesIO object at 0x..>`), not the file."""
    root = tmp_path / "train"
    bad = root / "a" / "broken.jpg"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not an image at all")
    index = scan_image_folder(str(root), "train")
    for load in (lambda: TrainDataset(index, size=16, seed=0)[(0, 0)], lambda: EvalDataset(index, 16, 18)[0]):
        with pytest.raises(CorruptImageError) as caught:
            load()
        assert str(bad) in str(caught.value)
        assert "object at 0x" not in str(caught.value)


def test_truncated_jpeg_raises_corrupt_image_error_naming_the_file(tmp_path):
    root = tmp_path / "train"
    path = root / "a" / "cut.jpg"
    write_jpeg(str(path), 64, 64, seed=3)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CorruptImageError) as caught:
        EvalDataset(scan_image_folder(str(root), "train"), size=16, resize=18)[0]
    assert_names(str(caught.value), path, "truncated")
    assert ".cpp" not in str(caught.value)  # torchvision's C++ source place is no use to the user


@pytest.mark.parametrize("said, shown", [
    ("decode_jpeg, /__w/vision/torchvision/csrc/io/image/cpu/decode_jpeg.cpp:167, Image is incomplete or truncated",
     "Image is incomplete or truncated"),
    ("Unsupported marker type 0x5d\nException raised from decode at /src/decode.cpp:12 (most recent call first):",
     "Unsupported marker type 0x5d"),
    ("image file is truncated (8 bytes not processed)", "image file is truncated (8 bytes not processed)"),
])
def test_a_decoders_message_loses_its_cpp_source_place(said, shown):
    assert decoder_said(RuntimeError(said)) == shown


def test_full_scale_jpeg_decode_gives_pillows_pixels_cropped_and_resized(tmp_path):
    """Crops too large for DCT scaling go through torchvision's decoder: the same pixels as Pillow's."""
    path = tmp_path / "a.jpg"
    write_jpeg(str(path), 120, 90, seed=4)
    box = (10.0, 5.0, 100.0, 80.0)  # to 48 px: a 1/2 DCT scale would leave 40 rows, so full scale
    pixels = decode_bytes(path.read_bytes(), str(path), lambda w, h: (box, True), 48)
    reference = torch.from_numpy(np.array(Image.open(path).convert("RGB")))
    assert torch.equal(pixels, crop_resize(reference, box, True, 48))
    assert pixels.shape == (48, 48, 3) and pixels.dtype == torch.uint8


def test_only_the_decoders_failures_are_called_a_corrupt_image(tmp_path):
    """A failure of ours while decoding (here in the crop's choice) stays what it is, with its traceback, instead
    of blaming the file; a file the decoder cannot read is still a CorruptImageError naming it."""
    path = tmp_path / "a.jpg"
    write_jpeg(str(path), 64, 48, seed=1)

    def broken_choice(width: int, height: int):
        raise RuntimeError("a bug in the crop's choice")

    with pytest.raises(RuntimeError, match="a bug in the crop's choice") as caught:
        decode_bytes(path.read_bytes(), str(path), broken_choice, 32)
    assert not isinstance(caught.value, CorruptImageError)
    with pytest.raises(CorruptImageError, match=f"cannot decode image file {path}"):
        decode_bytes(path.read_bytes()[:300], str(path), lambda w, h: ((0, 0, w, h), False), 32)
