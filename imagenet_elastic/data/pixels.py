"""What one image becomes, as HWC uint8 on any device. Training: the drawn crop, decoded at a reduced DCT scale where
it allows (`decode_bytes`). Validation: the reference's pixels (`CentreCrop`), so that a score we record is the one
timm's own evaluation gives the same weights."""

from __future__ import annotations

import contextlib
import io
import math
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from imagenet_elastic.errors import UNIDENTIFIED_IMAGE, CorruptImageError, first_line

Box = tuple[float, float, float, float]  # left, top, width, height in source pixels
ChooseCrop = Callable[[int, int], tuple[Box, bool]]  # (width, height) -> crop box, and whether to flip it


def random_resized_crop_box(width: int, height: int, rng: random.Random,
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> Box:
    """Inception-style crop: a random area fraction and aspect ratio, 10 tries, then a centre crop (at least 1 px a
    side: an extreme --ratio would round a side to 0)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target_area * aspect)), round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    aspect = min(max(width / height, ratio[0]), ratio[1])
    w, h = (width, round(width / aspect)) if width / height <= aspect else (round(height * aspect), height)
    w, h = max(1, w), max(1, h)
    return (width - w) // 2, (height - h) // 2, w, h


INTERPOLATIONS = ("bilinear", "bicubic")  # validation's resize, as timm's pretrained configs name them
DECODED_BY_TORCHVISION = ("RGB", "L")  # validation's JPEG modes for torchvision (CMYK, YCCK: the same pixels by Pillow)


@dataclass(frozen=True)
class CentreCrop:
    """Validation's view, the reference's: timm's `create_transform` for a pretrained config (and torchvision's
    ImageNet evaluation) resize the short side to `resize`, antialiased, and keep the centred `size` square. Here with
    torchvision's kernels: on the CPU uint8, within 2 levels of Pillow's; elsewhere float32, rounded."""

    size: int
    resize: int
    interpolation: str = "bilinear"

    def apply(self, pixels: torch.Tensor) -> torch.Tensor:
        """HWC uint8 (any device) -> size x size x 3 uint8."""
        from torchvision.transforms.v2 import InterpolationMode  # see pipeline.share_heap_with_workers
        from torchvision.transforms.v2 import functional as TF

        resized = TF.resize(pixels.permute(2, 0, 1), [self.resize], InterpolationMode(self.interpolation),
                            antialias=True)
        return TF.center_crop(resized, [self.size]).permute(1, 2, 0)


def decode_centre_crop(raw: bytes, path: str, view: CentreCrop) -> torch.Tensor:
    """Validation's size x size x 3 uint8 of the whole image in RGB as the reference's `Image.open(...).convert("RGB")`
    gives it (RGB or grey JPEGs by torchvision's libjpeg-turbo: Pillow's pixels), without DCT scaling."""
    with decoding(path), Image.open(io.BytesIO(raw)) as img:
        pixels = rgb(img, raw, img.format == "JPEG" and img.mode in DECODED_BY_TORCHVISION)
    return view.apply(pixels)


def decode_bytes(raw: bytes, path: str, choose_crop: ChooseCrop, size: int) -> torch.Tensor:
    """An image's bytes decoded, the box `choose_crop(width, height)` picks from the header's size cropped and resized
    to size x size: RGB uint8 HWC. A JPEG decodes at the smallest DCT scale (Pillow's draft mode) keeping the crop at
    least `size` a side, else by torchvision's libjpeg-turbo (faster than Pillow, the same pixels)."""
    with decoding(path):
        img = Image.open(io.BytesIO(raw))
        width, height = img.size
    with img:
        (left, top, w, h), flip = choose_crop(width, height)  # ours: an error here is a bug, not a bad file
        shrink = max(size / w, size / h)
        with decoding(path):
            if img.format == "JPEG" and shrink <= 0.5:
                img.draft("RGB", (math.ceil(width * shrink), math.ceil(height * shrink)))
            pixels = rgb(img, raw, img.format == "JPEG" and img.size == (width, height))
        fx, fy = img.size[0] / width, img.size[1] / height
    return crop_resize(pixels, (left * fx, top * fy, w * fx, h * fy), flip, size)


def rgb(img: Image.Image, raw: bytes, by_torchvision: bool) -> torch.Tensor:
    """An opened image's pixels, HWC uint8 RGB: decoded from `raw` by torchvision, or by Pillow."""
    if by_torchvision:
        from torchvision.io import ImageReadMode, decode_jpeg  # see pipeline.share_heap_with_workers
        return decode_jpeg(byte_tensor(raw), mode=ImageReadMode.RGB).permute(1, 2, 0)
    return torch.from_numpy(np.array(img if img.mode == "RGB" else img.convert("RGB")))


@contextlib.contextmanager
def decoding(path: str) -> Iterator[None]:
    """The decoders' own failures as a CorruptImageError naming the file; around decoding alone, so that a failure
    of ours is not called a bad file. torchvision's JPEG decoder reports a corrupt file as a RuntimeError."""
    try:
        yield
    except Image.UnidentifiedImageError:
        raise CorruptImageError(f"cannot decode image file {path}: {UNIDENTIFIED_IMAGE}") from None
    except (OSError, ValueError, SyntaxError, RuntimeError, Image.DecompressionBombError) as error:
        raise CorruptImageError(f"cannot decode image file {path}: {decoder_said(error)}") from None


def decoder_said(error: BaseException) -> str:
    """A decoder's message without the C++ source place torchvision's puts in it ("decode_jpeg, /__w/.../csrc/io/
    image/cpu/decode_jpeg.cpp:167, Image is incomplete or truncated"), which tells the user nothing."""
    return re.sub(r"(\w+, )?\S+\.(cpp|cc|cu|h|hpp):\d+(, |\s*)", "", first_line(error)).strip() or type(error).__name__


def byte_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def crop_resize(pixels: torch.Tensor, box: Box, flip: bool, size: int) -> torch.Tensor:
    """HWC uint8 (any device) -> the box's pixels resized to size x size, flipped if asked: HWC uint8."""
    out = resize_uint8(crop_region(pixels, box), size, uint8_kernel=pixels.device.type == "cpu")[0].permute(1, 2, 0)
    return out.flip(1) if flip else out


def crop_region(pixels: torch.Tensor, box: Box) -> torch.Tensor:
    """HWC -> the box's whole pixels as a 1CHW view (channels_last strides), no copy."""
    left, top, w, h = box
    rows, cols = pixel_span(top, h, pixels.shape[0]), pixel_span(left, w, pixels.shape[1])
    return pixels[rows, cols].permute(2, 0, 1).unsqueeze(0)


def resize_uint8(region: torch.Tensor, size: int, uint8_kernel: bool) -> torch.Tensor:
    """Antialiased bilinear resize of NCHW uint8; only the CPU has a uint8 kernel (elsewhere float32, rounded as it
    rounds). On the CPU the region is first made dense channels_last: faster, and its HWC output contiguous."""
    if uint8_kernel:
        region = region.contiguous(memory_format=torch.channels_last)
    resized = F.interpolate(region if uint8_kernel else region.float(), size=(size, size), mode="bilinear",
                            antialias=True, align_corners=False)
    return resized if uint8_kernel else resized.round_().clamp_(0, 255).to(torch.uint8)


def pixel_span(start: float, length: float, limit: int) -> slice:
    """Whole pixels covering [start, start + length), at least one, inside [0, limit)."""
    first = min(max(0, round(start)), limit - 1)
    return slice(first, max(first + 1, min(limit, round(start + length))))
