"""How a batch of uint8 pixels on the device becomes the model's input: normalisation (on 0-255 levels), memory layout
and autocast precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

IMAGENET_MEAN_FRACTIONS, IMAGENET_STD_FRACTIONS = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # of 0-1 values
IMAGENET_MEAN = tuple(m * 255 for m in IMAGENET_MEAN_FRACTIONS)
IMAGENET_STD = tuple(s * 255 for s in IMAGENET_STD_FRACTIONS)


@dataclass
class ModelInput:
    """How a batch of uint8 pixels becomes the model's input: all a validation pass needs."""

    device: torch.device
    amp_dtype: Optional[torch.dtype]
    channels_last: bool
    normalisation: tuple[tuple[float, ...], tuple[float, ...]] = (IMAGENET_MEAN, IMAGENET_STD)

    def __post_init__(self) -> None:
        self.mean, self.std = (torch.tensor(rgb, device=self.device).view(1, 3, 1, 1) for rgb in self.normalisation)

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None)


def prepare_batch(images: torch.Tensor, labels: torch.Tensor, to: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 NHWC already on the device to normalised float NCHW. The permute of NHWC already has channels_last
    strides, so that layout costs nothing; the other is made while the pixels are uint8 (a quarter of the bytes)."""
    images = images.permute(0, 3, 1, 2)
    if not to.channels_last:
        images = images.contiguous()
    return images.float().sub_(to.mean).div_(to.std), labels
