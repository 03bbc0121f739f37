"""The augmentation policy and random erasing of a whole batch on the device, from numbers the workers drew: each
operation runs once per stage on the sub-batch that drew it, whatever the batch size. Each computes torchvision's
tensor kernel (same formulas, same float32 steps), so the pixels are `Augment.apply(..., pil=False)`'s image by image,
up to float32 rounding where torchvision fuses a multiply-add."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

from imagenet_elastic.data.augment import MEAN_PIXEL, Draws

# Every operation torchvision's ImageNet policies (AutoAugment, RandAugment, TrivialAugmentWide) draw, by name.
OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
       "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert")
CODE = {name: code for code, name in enumerate(OPS)}
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
# One sample's numbers for one operation: blend factor and 1 - factor (as float32 of torchvision's doubles),
# solarize threshold, posterize bit mask, the 2 x 3 inverse affine matrix.
FACTOR, ONE_MINUS, THRESHOLD, MASK, THETA = 0, 1, 2, 3, 4
PER_OP = THETA + 6


def op_numbers(op: str, magnitude: float, size: int) -> list[float]:
    """The parameters torchvision's tensor kernel would be called with for `op` at `magnitude` on a size x size
    image (torchvision.transforms.v2's `_AutoAugmentBase._apply_image_or_video_transform`)."""
    numbers = [0.0] * PER_OP
    if op in ("Brightness", "Color", "Contrast", "Sharpness"):
        factor = 1.0 + magnitude
        numbers[FACTOR], numbers[ONE_MINUS] = factor, 1.0 - factor
    elif op == "Posterize":
        bits = int(magnitude)
        numbers[MASK] = 255 if bits >= 8 else ((1 << bits) - 1) << (8 - bits)
    elif op == "Solarize":
        numbers[THRESHOLD] = 255.0 * magnitude
    elif op in GEOMETRIC:
        numbers[THETA:] = inverse_affine(op, magnitude, size)
    return numbers


def inverse_affine(op: str, magnitude: float, size: int) -> list[float]:
    """torchvision's inverse affine matrix (output -> input pixel, about the centre) for `op` on a size x size image."""
    from torchvision.transforms.functional import _get_inverse_affine_matrix  # torchvision's own, for its numbers

    corner, none = [-size * 0.5, -size * 0.5], [0.0, 0.0]  # `center=[0, 0]` (the top-left corner), centred
    shear, shift = math.degrees(math.atan(magnitude)), float(int(magnitude))
    centre, angle, translate, shears = {  # torchvision's arguments of `affine` for each operation
        "ShearX": (corner, 0.0, none, [shear, 0.0]), "ShearY": (corner, 0.0, none, [0.0, shear]),
        "TranslateX": (none, 0.0, [shift, 0.0], none), "TranslateY": (none, 0.0, [0.0, shift], none),
        "Rotate": (none, -(magnitude % 360), none, none),
    }[op]
    return _get_inverse_affine_matrix(centre, angle, translate, 1.0, shears)


@dataclass
class PolicyPlan:
    """A batch's policy and erasing as tensors: `order[k]`, the samples by the operation drawn at stage k; `counts`
    (host ints), how many drew each, so every sub-batch is a slice of `order` and the host reads no device value."""

    order: torch.Tensor  # stages x N int64
    counts: list[list[int]]  # stages x len(OPS)
    numbers: torch.Tensor  # N x stages x PER_OP float32
    erase: Optional[torch.Tensor]  # N x 4 int64: top, left, height, width (height 0: nothing erased); None: no erasing

    @classmethod
    def pack(cls, draws: Sequence[Optional[Draws]], size: int) -> Optional[PolicyPlan]:
        """The draws of a batch's samples at crop size `size` (None: the batch has no second pass)."""
        if all(d is None for d in draws):
            return None
        drawn = [d if d is not None else Draws() for d in draws]
        stages = max(len(d.ops) for d in drawn)
        codes = [[CODE[d.ops[k][0]] if k < len(d.ops) else CODE["Identity"] for d in drawn] for k in range(stages)]
        numbers = [[op_numbers(*d.ops[k], size) if k < len(d.ops) else [0.0] * PER_OP for k in range(stages)]
                   for d in drawn]
        erase = (torch.tensor([d.erase or (0, 0, 0, 0) for d in drawn], dtype=torch.int64)
                 if any(d.erase is not None for d in drawn) else None)
        return cls(torch.tensor([sorted(range(len(drawn)), key=stage.__getitem__) for stage in codes],
                                dtype=torch.int64).view(stages, len(drawn)),
                   [[stage.count(code) for code in range(len(OPS))] for stage in codes],
                   torch.tensor(numbers, dtype=torch.float32).view(len(drawn), stages, PER_OP), erase)

    def pin_memory(self) -> PolicyPlan:
        return self.map(torch.Tensor.pin_memory)

    def to(self, device: torch.device) -> PolicyPlan:
        return self.map(lambda t: t.to(device, non_blocking=True))

    def map(self, change: Callable[[torch.Tensor], torch.Tensor]) -> PolicyPlan:
        return replace(self, order=change(self.order), numbers=change(self.numbers),
                       erase=None if self.erase is None else change(self.erase))

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """N x size x size x 3 uint8 changed in place: each stage's operations on their sub-batches, then erasing."""
        chw = images.permute(0, 3, 1, 2)  # a view: the kernels take channels-first
        for stage, counts in enumerate(self.counts):
            start = 0
            for code, count in enumerate(counts):
                if count and OPS[code] != "Identity":
                    rows = self.order[stage, start:start + count]
                    params = self.numbers[:, stage].index_select(0, rows)
                    chw.index_copy_(0, rows, KERNELS[OPS[code]](chw.index_select(0, rows), params))
                start += count
        if self.erase is not None:
            erase_boxes(chw, self.erase)
        return images


def column(params: torch.Tensor, which: int) -> torch.Tensor:
    return params[:, which, None, None, None]


def blend(images: torch.Tensor, other: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """torchvision's `_blend` with a factor per image: images * factor + other * (1 - factor), clamped, truncated.
    `addcmul_` for its `add_(other, alpha=1 - factor)`: both round the multiply-add once."""
    out = images.mul(column(params, FACTOR)).addcmul_(other, column(params, ONE_MINUS))
    return out.clamp_(0, 255).to(torch.uint8)


def grey(images: torch.Tensor) -> torch.Tensor:
    """torchvision's float grey level of uint8 RGB, floored as its saturation and contrast floor it."""
    r, g, b = images.unbind(dim=1)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).floor_().unsqueeze(1)


def sharpness(images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """torchvision's: inner pixels moved towards a 3 x 3 smoothing (5/13 centre, 1/13 each neighbour), rounded."""
    if images.shape[-1] <= 2 or images.shape[-2] <= 2:
        return images
    out = images.float()
    blurred = F.conv2d(out, smoothing_kernel(out.device), groups=3).round_()
    inner = out[..., 1:-1, 1:-1]
    inner.addcmul_(blurred.sub_(inner), column(params, ONE_MINUS))
    return out.clamp_(0, 255).to(torch.uint8)


@functools.cache
def smoothing_kernel(device: torch.device) -> torch.Tensor:
    edge, centre = 1.0 / 13.0, 5.0 / 13.0
    kernel = torch.tensor([[edge, edge, edge], [edge, centre, edge], [edge, edge, edge]], dtype=torch.float32)
    return kernel.expand(3, 1, 3, 3).to(device)


def affine(images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Shears, translations and rotations at once: torchvision's grid (pixel centres about the image's centre,
    through each image's inverse matrix, normalised by half the size), nearest sampling, zeros outside."""
    n, _, height, width = images.shape
    assert height == width, "training crops are square"  # so both axes normalise by one number, on the host
    theta = params[:, THETA:].reshape(n, 2, 3).transpose(1, 2) / (0.5 * width)
    grid = pixel_centres(height, width, images.device).expand(n, -1, -1).bmm(theta).view(n, height, width, 2)
    out = F.grid_sample(images.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False)
    return out.round_().to(torch.uint8)


@functools.lru_cache(maxsize=8)
def pixel_centres(height: int, width: int, device: torch.device) -> torch.Tensor:
    """1 x (height * width) x 3: each pixel's centre (x, y) relative to the image's centre, and 1."""
    ys, xs = torch.meshgrid(torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, steps=height),
                            torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, steps=width), indexing="ij")
    return torch.stack([xs, ys, torch.ones_like(xs)], dim=-1).view(1, height * width, 3).to(device)


def parameterless(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """torchvision's own kernel, which takes a batch as it is (autocontrast, equalize, invert)."""
    def run(images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as TF

        return getattr(TF, name)(images)
    return run


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    **dict.fromkeys(GEOMETRIC, affine),
    "Brightness": lambda images, params: images.mul(column(params, FACTOR)).clamp_(0, 255).to(torch.uint8),
    "Color": lambda images, params: blend(images, grey(images), params),
    "Contrast": lambda images, params: blend(images, grey(images).mean(dim=(1, 2, 3), keepdim=True), params),
    "Sharpness": sharpness,
    "Posterize": lambda images, params: images & column(params, MASK).to(torch.uint8),
    "Solarize": lambda images, params: torch.where(images >= column(params, THRESHOLD), images.bitwise_not(), images),
    **{op: parameterless(op.lower()) for op in ("AutoContrast", "Equalize", "Invert")},
}


def erase_boxes(images: torch.Tensor, boxes: torch.Tensor) -> None:
    """Each image's box (top, left, height, width; height 0: none) set to the mean pixel, in place, as one mask."""
    height, width = images.shape[-2:]
    top, left, tall, wide = boxes.unbind(dim=1)
    rows = torch.arange(height, device=images.device)
    cols = torch.arange(width, device=images.device)
    inside = (((rows >= top[:, None]) & (rows < (top + tall)[:, None]))[:, :, None]
              & ((cols >= left[:, None]) & (cols < (left + wide)[:, None]))[:, None, :])
    images.copy_(torch.where(inside[:, None], mean_pixel(images.device), images))


@functools.cache
def mean_pixel(device: torch.device) -> torch.Tensor:
    """1 x 3 x 1 x 1 uint8 made on the device once (a host value per batch would wait on a pageable copy)."""
    return torch.tensor(MEAN_PIXEL, dtype=torch.uint8).view(1, 3, 1, 1).to(device)
