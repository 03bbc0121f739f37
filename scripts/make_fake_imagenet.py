#!/usr/bin/env python3
"""Write a small, learnable ImageFolder of JPEGs (OUT/train/CLASS/*.jpg, OUT/val/CLASS/*.jpg).

Each class is a coloured shape (disc, square, bars, ring, ... in its own hue) at a random place and
size on a noisy background, so a small network learns it within a few epochs. Deterministic in --seed.

With --mirrored, classes come in pairs that differ only by a left-right mirror (an L-shaped mark and
its mirror image, in the pair's hue), like letters or handwriting: there a flipped training image
is a sample of the other class, which is what `--hflip 0` is for.

    python scripts/make_fake_imagenet.py demo_data --classes 10 --train-per-class 64 --val-per-class 16
"""

from __future__ import annotations

import argparse
import colorsys
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--train-per-class", type=int, default=64)
    p.add_argument("--val-per-class", type=int, default=16)
    p.add_argument("--size", default="80x64", help="WIDTHxHEIGHT of every image")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mirrored", action="store_true", help="classes in pairs that differ only by a mirror image")
    a = p.parse_args()
    size = tuple(int(v) for v in a.size.lower().split("x"))
    n_train = make_split(a.out, "train", a.classes, a.train_per_class, size, a.seed, a.mirrored)
    n_val = make_split(a.out, "val", a.classes, a.val_per_class, size, a.seed, a.mirrored)
    print(f"wrote {n_train} train and {n_val} val images of {a.classes} classes to {a.out}")


if __name__ == "__main__":
    main()
