"""Validation's input pipeline alone: what one process spends turning ImageNet-sized JPEGs (500x375 and
375x500, quality 90, as most of ImageNet's validation set) into validation crops, at a few crop sizes. No
loader workers, one thread: the figure is per core (a loader with N workers scales it by about N). Reported
as CPU time (the process's own, which other processes on a shared machine do not inflate) and the images per
second that CPU time allows, best of the rounds.

    python scripts/val_pixels_benchmark.py [--images 200] [--rounds 5] [--timm]

--timm: timm's own evaluation transform (`create_transform` of a config with the same crop: Pillow's decode,
resize and centre crop, then to a float tensor) on the same bytes, for comparison.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time

import numpy as np
import torch
from PIL import Image

from imagenet_elastic.data.pipeline import EvalDataset


class Jpegs:
    """A source of JPEGs made here: smooth colour fields with noise, landscape and portrait alternating."""

    def __init__(self, count: int) -> None:
        rng = np.random.default_rng(0)
        self.images = []
        for i in range(count):
            w, h = (500, 375) if i % 2 == 0 else (375, 500)
            x, y = np.linspace(0, 1, w)[None, :, None], np.linspace(0, 1, h)[:, None, None]
            pixels = 127 + 100 * np.sin(8 * x + 3 * y + np.arange(3) + i) + rng.normal(0, 20, (h, w, 3))
            out = io.BytesIO()
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
            self.images.append(out.getvalue())
        self.labels = np.zeros(count, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.images)

    def read(self, i: int) -> bytes:
        return self.images[i]

    def name(self, i: int) -> str:
        return f"image {i}"

    def label(self, i: int) -> int:
        return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timm", action="store_true", help="time timm's eval transform instead of ours")
    args = p.parse_args()
    torch.set_num_threads(1)
    source = Jpegs(args.images)
    for crop, resize in ((224, 256), (128, 146), (64, 73)):
        if args.timm:
            from timm.data import create_transform

            transform = create_transform((3, crop, crop), crop_pct=crop / resize, interpolation="bilinear")

            def item(i: int, transform=transform) -> object:
                return transform(Image.open(io.BytesIO(source.read(i))).convert("RGB"))
        else:
            item = EvalDataset(source, crop, resize).__getitem__
        item(0)  # imports and first-call costs out of the timing
        seconds = []
        for _ in range(args.rounds):
            start = time.process_time()
            for i in range(len(source)):
                item(i)
            seconds.append((time.process_time() - start) / len(source))
        print(json.dumps({"pipeline": "timm" if args.timm else "ours", "crop": crop, "resize": resize,
                          "cpu_ms_per_image": round(1e3 * min(seconds), 3),
                          "images_per_cpu_second": round(1 / min(seconds), 1),
                          "median_ms": round(1e3 * statistics.median(seconds), 3)}))


if __name__ == "__main__":
    main()
