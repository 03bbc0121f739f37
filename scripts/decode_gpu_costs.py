"""What `--decode gpu` costs the process that trains, measured on the CPU.

    python scripts/decode_gpu_costs.py [--batch 256] [--size 224] [--file-kb 110]

1. Handover: a loader worker's batch of `--batch` encoded files of `--file-kb` KB reaching the main process,
   as a list of one tensor per image (before gpu_decode.EncodedBatch) and as one tensor: main-process
   CPU time and wall time per batch (medians of 20 batches, 2 workers).
2. Operators dispatched per batch after the decode itself (views not counted): on a GPU each image-sized
   one is about one kernel launch from the training thread. The crops image by image in float32 (what
   the GPU path did before pixels.resize_regions), the batched crops, and the batched crops followed by
   TrivialAugmentWide and random erasing image by image (augment.Augment.apply on tensors, as the
   decoder runs them).
3. Host time per image of each policy and of erasing on the device path, on 8 x 8 images so that the
   kernels cost next to nothing: the Python and dispatch overhead the training thread pays per image on
   a GPU (one thread).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset, default_collate

from imagenet_elastic.data import gpu_decode, pixels
from imagenet_elastic.data.augment import Augment


class OpCounter(TorchDispatchMode):
    """Non-view operators, split by what they make: image-sized results (device kernels on a GPU) and
    results of fewer than 64 elements (the policies' random draws, which stay on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.image_sized = self.small = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.numel() >= 64:
                self.image_sized += 1
            else:
                self.small += 1
        return out


class EncodedFiles(Dataset):
    """Sample i: an EncodedImage of random bytes, as a worker hands a file over (no disk involved)."""

    def __init__(self, file_bytes: int) -> None:
        self.file_bytes = file_bytes

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> tuple:
        data = torch.randint(0, 256, (self.file_bytes,), dtype=torch.uint8)
        return gpu_decode.EncodedImage(f"/data/{i}.jpg", data, (0.0, 0.0, 1.0, 1.0), False, 224), 0, i


def as_list(samples: list[tuple]) -> list:
    """The collation before EncodedBatch: one tensor per image crosses from the worker."""
    images, *rest = zip(*samples)
    return [list(images), *(default_collate(list(column)) for column in rest)]


def handover(batch: int, file_bytes: int, collate) -> dict:
    loader = DataLoader(EncodedFiles(file_bytes), batch_size=batch, num_workers=2, collate_fn=collate,
                        prefetch_factor=2, persistent_workers=True)
    batches = iter(loader)
    for _ in range(4):  # workers started, queues full
        next(batches)
    cpu, wall = [], []
    for _ in range(20):
        time.sleep(0.3)  # the workers refill the queue: what is timed is the receiving alone
        c, w = time.process_time(), time.perf_counter()
        next(batches)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return {"main_cpu_ms": round(1000 * statistics.median(cpu), 1), "wall_ms": round(1000 * statistics.median(wall), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--file-kb", type=int, default=110)
    args = parser.parse_args()
    for name, collate in (("one tensor per image (before)", as_list), ("one tensor per batch", gpu_decode.collate)):
        print(json.dumps({"handover": name, "batch": args.batch, "file_kb": args.file_kb,
                          **handover(args.batch, args.file_kb * 1000, collate)}), flush=True)
    rng, noise = random.Random(0), np.random.default_rng(0)
    decoded = [torch.from_numpy(noise.integers(0, 256, (375, 500, 3), dtype=np.uint8)) for _ in range(args.batch)]
    boxes = [pixels.random_resized_crop_box(500, 375, rng) for _ in decoded]
    flips = [rng.random() < 0.5 for _ in decoded]
    seeds = [rng.getrandbits(63) for _ in decoded]
    policy = Augment(policy="ta_wide", erase=0.1)

    def one_by_one() -> torch.Tensor:
        crops = []
        for image, box, flip in zip(decoded, boxes, flips):
            region = pixels.crop_region(image, box)
            crop = pixels.resize_uint8(region, args.size, uint8_kernel=False)[0].permute(1, 2, 0)
            crops.append(crop.flip(1) if flip else crop)
        return torch.stack(crops)

    def batched() -> torch.Tensor:
        regions = [pixels.crop_region(image, box) for image, box in zip(decoded, boxes)]
        return torch.stack(list(pixels.resize_regions(regions, flips, args.size)))

    def batched_with_policy() -> torch.Tensor:
        regions = [pixels.crop_region(image, box) for image, box in zip(decoded, boxes)]
        crops = pixels.resize_regions(regions, flips, args.size)
        return torch.stack([policy.apply(crop, seed, pil=False) for crop, seed in zip(crops, seeds)])

    reference = one_by_one()
    for name, variant in (("crops one by one (before)", one_by_one), ("crops batched", batched),
                          ("crops batched + ta_wide + random_erase 0.1", batched_with_policy)):
        with OpCounter() as counter:
            out = variant()
        same = torch.equal(out, reference) if name != "crops batched + ta_wide + random_erase 0.1" else None
        print(json.dumps({"variant": name, "batch": args.batch, "size": args.size,
                          "image_sized_ops": counter.image_sized, "small_ops": counter.small,
                          "image_sized_per_image": round(counter.image_sized / args.batch, 2),
                          "same_pixels_as_before": same}))
    policy_overhead()


def policy_overhead() -> None:
    torch.set_num_threads(1)
    tiny = torch.randint(0, 256, (8, 8, 3), dtype=torch.uint8)
    for policy, erase in (("none", 0.1), ("ta_wide", 0.0), ("ta_wide", 0.1), ("ra", 0.0), ("imagenet", 0.0)):
        augment = Augment(policy=policy, erase=erase)
        for seed in range(50):  # warm-up
            augment.apply(tiny, seed, pil=False)
        start = time.perf_counter()
        for seed in range(2000):
            augment.apply(tiny, seed, pil=False)
        print(json.dumps({"policy": policy, "random_erase": erase,
                          "host_us_per_image": round((time.perf_counter() - start) / 2000 * 1e6)}))


if __name__ == "__main__":
    main()
