"""--blurpool: FFCV's BlurPool, a binomial blur before each strided convolution, given to a model timm built (a run's,
a checkpoint's or an export's, which timm rebuilds without it)."""

from __future__ import annotations

import functools

import torch
from torch import nn

BLUR_MIN_CHANNELS = 16  # FFCV's rule: the stem's RGB convolution keeps its input as it is


def blur_strided_convs(model: nn.Module) -> list[str]:
    """FFCV's BlurPool: each convolution with a stride above 1 and at least 16 input channels first blurs its input
    by a 3x3 binomial filter (timm's BlurPool2d, stride 1, zero padding) against aliasing; returns their names. Each
    becomes a blurring subclass of its class with an unsaved filter: the state dict stays the plain model's, and
    torch.compile sees another class, not a forward hook, which dynamo does not guard on."""
    from timm.layers import BlurPool2d

    names = []
    for name, conv in list(model.named_modules()):  # listed first: the loop adds modules
        if (isinstance(conv, nn.Conv2d) and not isinstance(conv, _BlurFirst) and max(conv.stride) > 1
                and conv.in_channels >= BLUR_MIN_CHANNELS):
            conv.blur = BlurPool2d(conv.in_channels, filt_size=3, stride=1, pad_mode="constant").to(
                device=conv.weight.device, dtype=conv.weight.dtype)
            conv.__class__ = _blurred_class(type(conv))
            names.append(name)
    return names


def blurred(model: nn.Module) -> int:
    """How many convolutions blur_strided_convs gave a blur."""
    return sum(isinstance(m, _BlurFirst) for m in model.modules())


class _BlurFirst:
    """Put before a convolution class among its bases: its forward blurs the input, then convolves."""

    blur: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.blur(x))  # type: ignore[misc]


@functools.cache
def _blurred_class(conv_class: type) -> type:
    return type(f"Blurred{conv_class.__name__}", (_BlurFirst, conv_class), {"__module__": __name__})


BlurredConv2d = _blurred_class(nn.Conv2d)  # found by name: a whole pickled model (torch.save(model)) loads again
