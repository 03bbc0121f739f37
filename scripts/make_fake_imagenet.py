#!/usr/bin/env python3
"""Write a small, learnable ImageFolder of JPEGs (OUT/train/CLASS/*.jpg, OUT/val/CLASS/*.jpg).

Each class is a coloured shape (disc, square, bars, ring, ... in its own hue) at a random place and
size on a noisy background, so a small network learns it within a few epochs. Deterministic in --seed.

With --mirrored, classes come in pairs that differ only by a left-right mirror (an L-shaped mark and
its mirror image, in the pair's hue), like letters or handwriting: there a flipped training image
is a sample of the other class, which is what `--hflip 0` is for.

    python scripts/make_fake_imagenet.py demo_data --classes 10 --train-per-class 64 --val-per-class 16

With --photos, every image is instead a crop of a photograph, resized to --size and saved at quality 90: natural
image statistics, so decoding costs what ImageNet's JPEGs cost (the noise of the shapes' background decodes
slower). Class k cuts its crops from photograph k (modulo their number): for timing loaders, not for accuracy.
The photographs are those of a folder (`--photos DIR`), by default the ones scikit-image ships.

    python scripts/make_fake_imagenet.py /tmp/photos --photos --classes 100 --train-per-class 128 --size 500x375
"""

from __future__ import annotations

import argparse
import colorsys
import concurrent.futures
import os

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("disc", "square", "bars", "ring", "cross", "triangle")


def draw_sample(cls: int, num_classes: int, rng: np.random.Generator, width: int, height: int) -> Image.Image:
    background = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8) // 2 + 32
    img = Image.fromarray(background)
    hue = cls / num_classes
    colour = tuple(int(255 * c) for c in colorsys.hsv_to_rgb(hue, 0.9, 0.95))
    side = int(min(width, height) * rng.uniform(0.35, 0.7))
    x0 = int(rng.integers(0, width - side + 1))
    y0 = int(rng.integers(0, height - side + 1))
    box = (x0, y0, x0 + side, y0 + side)
    draw = ImageDraw.Draw(img)
    shape = SHAPES[cls % len(SHAPES)]
    if shape == "disc":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "bars":
        for i in range(0, side, max(2, side // 4)):
            draw.rectangle((x0 + i, y0, x0 + i + max(1, side // 8), y0 + side), fill=colour)
    elif shape == "ring":
        draw.ellipse(box, outline=colour, width=max(2, side // 6))
    elif shape == "cross":
        t = max(2, side // 5)
        mid_x, mid_y = x0 + side // 2, y0 + side // 2
        draw.rectangle((x0, mid_y - t // 2, x0 + side, mid_y + t // 2), fill=colour)
        draw.rectangle((mid_x - t // 2, y0, mid_x + t // 2, y0 + side), fill=colour)
    else:
        draw.polygon([(x0, y0 + side), (x0 + side, y0 + side), (x0 + side // 2, y0)], fill=colour)
    return img


def draw_mirrored(cls: int, num_classes: int, rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Class 2k: an L in hue k; class 2k + 1: the same picture mirrored left-right."""
    background = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8) // 2 + 32
    img = Image.fromarray(background)
    colour = tuple(int(255 * c) for c in colorsys.hsv_to_rgb((cls // 2) / max(1, num_classes // 2), 0.9, 0.95))
    side = int(min(width, height) * rng.uniform(0.35, 0.7))
    x0, y0 = int(rng.integers(0, width - side + 1)), int(rng.integers(0, height - side + 1))
    t = max(2, side // 4)
    draw = ImageDraw.Draw(img)
    draw.rectangle((x0, y0, x0 + t, y0 + side), fill=colour)  # the stem, on the left
    draw.rectangle((x0, y0 + side - t, x0 + side, y0 + side), fill=colour)  # the foot, pointing right
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if cls % 2 else img


def make_split(out: str, split: str, num_classes: int, per_class: int, size: tuple[int, int], seed: int,
               mirrored: bool = False) -> int:
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    draw = draw_mirrored if mirrored else draw_sample
    for cls in range(num_classes):
        folder = os.path.join(out, split, f"class_{cls:03d}")
        os.makedirs(folder, exist_ok=True)
        for i in range(per_class):
            draw(cls, num_classes, rng, *size).save(os.path.join(folder, f"{split}_{cls:03d}_{i:05d}.jpg"), quality=90)
    return num_classes * per_class


PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png")


def photo_folder(folder: str | None) -> list[str]:
    """The photographs to cut from: a folder's, or scikit-image's sample photographs (colour ones only)."""
    if folder is None:
        try:
            import skimage
        except ImportError:
            raise SystemExit("--photos: scikit-image is not installed; pip install scikit-image, or --photos DIR") \
                from None
        folder = os.path.join(os.path.dirname(skimage.__file__), "data")
    paths = sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.lower().endswith(PHOTO_SUFFIXES))
    colour = [path for path in paths if Image.open(path).mode in ("RGB", "RGBA", "P")]
    if not colour:
        raise SystemExit(f"--photos: no colour photographs (.jpg, .png) in {folder}")
    return colour


def photo_class(photo: str, out: str, split: str, cls: int, count: int, size: tuple[int, int], seed: int) -> int:
    """`count` crops of one photograph (between a third and all of its shorter side, aspect ratio of --size
    within 25%), resized to `size`, each from its own (seed, split, class, index) stream."""
    source = Image.open(photo).convert("RGB")
    folder = os.path.join(out, split, f"class_{cls:03d}")
    os.makedirs(folder, exist_ok=True)
    width, height = size
    for i in range(count):
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, cls, i])
        aspect = width / height * rng.uniform(0.8, 1.25)
        crop_h = int(min(source.height, source.width / aspect) * rng.uniform(0.35, 1.0))
        crop_w = min(source.width, int(crop_h * aspect))
        left = int(rng.integers(0, source.width - crop_w + 1))
        top = int(rng.integers(0, source.height - crop_h + 1))
        image = source.crop((left, top, left + crop_w, top + crop_h)).resize(size, Image.Resampling.BICUBIC)
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        image.save(os.path.join(folder, f"{split}_{cls:03d}_{i:05d}.jpg"), quality=90)
    return count


def make_photo_splits(out: str, photos: list[str], num_classes: int, per_split: dict[str, int],
                      size: tuple[int, int], seed: int, jobs: int) -> dict[str, int]:
    """Every class of every split, `jobs` processes at a time; the images do not depend on `jobs`."""
    with concurrent.futures.ProcessPoolExecutor(max(1, jobs)) as pool:
        futures = {split: [pool.submit(photo_class, photos[cls % len(photos)], out, split, cls, count, size, seed)
                           for cls in range(num_classes)] for split, count in per_split.items()}
        return {split: sum(f.result() for f in done) for split, done in futures.items()}


def image_size(text: str) -> tuple[int, int]:
    """--size: `80x64` -> (80, 64)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT (80x64), got {text!r}") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return width, height


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--train-per-class", type=int, default=64)
    p.add_argument("--val-per-class", type=int, default=16)
    p.add_argument("--size", default=(80, 64), type=image_size, help="WIDTHxHEIGHT of every image")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mirrored", action="store_true", help="classes in pairs that differ only by a mirror image")
    p.add_argument("--photos", nargs="?", const="", metavar="DIR",
                   help="crops of photographs (DIR's, else scikit-image's) instead of shapes on noise")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="--photos: processes writing images")
    a = p.parse_args()
    size = a.size
    if a.photos is not None:
        counts = make_photo_splits(a.out, photo_folder(a.photos or None), a.classes,
                                   {"train": a.train_per_class, "val": a.val_per_class}, size, a.seed, a.jobs)
        print(f"wrote {counts['train']} train and {counts['val']} val photo crops of {a.classes} classes to {a.out}")
        return
    n_train = make_split(a.out, "train", a.classes, a.train_per_class, size, a.seed, a.mirrored)
    n_val = make_split(a.out, "val", a.classes, a.val_per_class, size, a.seed, a.mirrored)
    print(f"wrote {n_train} train and {n_val} val images of {a.classes} classes to {a.out}")


if __name__ == "__main__":
    main()
