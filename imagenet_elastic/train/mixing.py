"""Mixup and CutMix on the device, per optimizer step. Images 2k and 2k+1 of the *global* batch are partners, and
pair k draws lambda (Beta(alpha, alpha)), kind (half each when both are on) and box from a (seed, step) stream alone:
it mixes the same on any rank, in any micro-batch and after any restart, if every micro-batch holds whole pairs
(`check_pairs`). torchvision's and timm's pair neighbours in the local batch and draw from the global generators, so
their mixing changes with the world size; the rest follows timm (a box of side sqrt(1 - lambda) centred anywhere and
clipped, lambda corrected to the area pasted)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.errors import UserError

STREAM = 0x6D6978  # "mix": keeps these draws apart from every other (seed, step) stream


@dataclass(frozen=True)
class PairDraws:
    """What each pair of a global batch draws at one step (arrays of one entry per pair)."""

    lam: np.ndarray  # weight of an image's own pixels and label, before the cutmix correction
    cut: np.ndarray  # True: cutmix, False: mixup
    centre_y: np.ndarray  # the cutmix box's centre, as a fraction of the height and width
    centre_x: np.ndarray


@dataclass(frozen=True)
class Mixer:
    mixup_alpha: float
    cutmix_alpha: float
    num_classes: int

    def draws(self, seed: int, step: int, pairs: int) -> PairDraws:
        """The first `pairs` pairs' draws at step `step`: a prefix of the same stream whatever `pairs` is, each
        quantity from its own stream, so switching one kind off leaves the other's draws as they were."""
        streams = [np.random.Generator(np.random.PCG64(np.random.SeedSequence([STREAM, seed, step, part])))
                   for part in range(5)]
        mixup = streams[0].beta(self.mixup_alpha, self.mixup_alpha, pairs) if self.mixup_alpha > 0 else None
        cutmix = streams[1].beta(self.cutmix_alpha, self.cutmix_alpha, pairs) if self.cutmix_alpha > 0 else None
        both = mixup is not None and cutmix is not None
        cut = streams[2].random(pairs) < 0.5 if both else np.full(pairs, cutmix is not None)
        lam = np.where(cut, cutmix if cutmix is not None else 0.0, mixup if mixup is not None else 0.0)
        return PairDraws(lam, cut, streams[3].random(pairs), streams[4].random(pairs))

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, seed: int, step: int, start: int,
                 channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch (float NCHW, labels) at global position `start` -> mixed images, unsmoothed soft targets."""
        n, _, height, width = images.shape
        first = start // 2
        d = self.draws(seed, step, first + n // 2)
        lam, cut = d.lam[first:], d.cut[first:]
        top, bottom, left, right = cut_boxes(lam, d.centre_y[first:], d.centre_x[first:], height, width)
        area = (bottom - top) * (right - left) / (height * width)
        lam = np.where(cut, 1.0 - area, lam)  # the share of its own pixels each image actually keeps
        # one row per image (both images of a pair share their pair's values), in one copy to the device
        host = torch.from_numpy(np.repeat(np.stack([lam, cut, top, bottom, left, right]).astype(np.float32), 2, axis=1))
        if images.device.type == "cuda":  # a copy from pageable memory waits for the stream's queue: the last step
            host = host.pin_memory()
        lam_t, cut_t, top_t, bottom_t, left_t, right_t = host.to(images.device, non_blocking=True).view(6, n, 1, 1)
        partner = torch.arange(n, device=images.device) ^ 1  # 0<->1, 2<->3, ...
        rows = torch.arange(height, device=images.device, dtype=torch.float32).view(1, height, 1)
        cols = torch.arange(width, device=images.device, dtype=torch.float32).view(1, 1, width)
        inside = (rows >= top_t) & (rows < bottom_t) & (cols >= left_t) & (cols < right_t)
        own = torch.where(cut_t > 0, (~inside).float(), lam_t).unsqueeze(1)
        mixed = images * own + images[partner] * (1.0 - own)
        onehot = F.one_hot(labels, self.num_classes).float()
        targets = onehot * lam_t.view(n, 1) + onehot[partner] * (1.0 - lam_t.view(n, 1))
        layout = torch.channels_last if channels_last else torch.contiguous_format
        return mixed.contiguous(memory_format=layout), targets


def cut_boxes(lam: np.ndarray, centre_y: np.ndarray, centre_x: np.ndarray, height: int, width: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """CutMix's boxes in whole pixels (top, bottom, left, right; bottom and right exclusive), clipped."""
    side = np.sqrt(1.0 - lam)
    half_h, half_w = (side * height).astype(np.int64) // 2, (side * width).astype(np.int64) // 2
    cy, cx = (centre_y * height).astype(np.int64), (centre_x * width).astype(np.int64)
    return (np.clip(cy - half_h, 0, height), np.clip(cy + half_h, 0, height),
            np.clip(cx - half_w, 0, width), np.clip(cx + half_w, 0, width))


def whole_pairs(part: slice) -> bool:
    return not (part.start % 2 or (part.stop - part.start) % 2)


def check_pairs(plan: BatchPlan) -> None:
    """Every micro-batch of every rank must hold whole pairs."""
    for rank in range(plan.world_size):
        slices = plan.micro_slices(rank)
        if not all(map(whole_pairs, slices)):
            sizes = "/".join(str(s.stop - s.start) for s in slices)
            raise UserError(
                f"--mixup-alpha/--cutmix-alpha mix the images of a global batch in pairs (positions 2k and "
                f"2k+1), so every micro-batch must hold whole pairs; {plan.describe()} gives rank {rank} "
                f"micro-batches of {sizes}: choose --global-batch-size and --batch-size so that each is even")
