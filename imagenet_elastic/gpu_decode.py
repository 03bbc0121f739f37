"""`--decode gpu`: loader workers only read files; the main process decodes whole batches with nvJPEG.

A worker reads the file, parses the header for the size, and draws the crop and flip from the
sample's own random stream, exactly as the CPU path does (data.TrainDataset), so the augmentation
contract holds: the same boxes and flips for the same (seed, epoch, index). It hands over the
bytes and the box. The main process decodes the batch with one batched
`torchvision.io.decode_jpeg(..., device=...)` call, then crops, resizes and flips each image on
the device.

Images nvJPEG cannot take are decoded on the CPU instead, and each reason is reported once:
PNGs and other formats, and CMYK/YCCK JPEGs, are recognised from the header by the worker, which
decodes them itself; a JPEG that the device decoder rejects is decoded in the main process.
A file that neither can decode is a CorruptImageError naming it, as on the CPU path.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from PIL import Image
from torch.utils.data import default_collate

from imagenet_elastic.data import (
    Box,
    ChooseCrop,
    Load,
    byte_tensor,
    crop_resize,
    decode_bytes,
    decode_region,
    read_file,
)
from imagenet_elastic.errors import CorruptImageError

DEVICE_DECODABLE_MODES = ("RGB", "L")  # JPEG colour modes nvJPEG turns into RGB

OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError: 2.5+


@dataclass
class EncodedImage:
    """One image as a worker hands it over: its bytes and where to crop, or (`cpu_reason` set) its
    pixels already decoded and cropped on the CPU."""

    path: str
    data: torch.Tensor  # 1-D uint8 file bytes, or size x size x 3 uint8 pixels
    box: Box
    flip: bool
    size: int  # of the square crop the batch wants (train and val sizes may differ)
    cpu_reason: Optional[str] = None


def encode_region(path: str, choose_crop: ChooseCrop, size: int) -> EncodedImage:
    """The worker's part: read, parse the header, draw the crop (same signature as data.decode_region)."""
    raw = read_file(path)
    try:
        with Image.open(io.BytesIO(raw)) as img:
            width, height = img.size
            kind, mode = img.format, img.mode
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise CorruptImageError(f"cannot decode image file {path}: {error}") from None
    box, flip = choose_crop(width, height)
    if kind == "JPEG" and mode in DEVICE_DECODABLE_MODES:
        return EncodedImage(path, byte_tensor(raw), box, flip, size)
    reason = f"a {mode} JPEG" if kind == "JPEG" else f"a {kind} file"
    return EncodedImage(path, decode_bytes(raw, path, lambda w, h: (box, flip), size), box, flip, size, reason)


def worker_functions(decode: str) -> tuple[Load, Optional[Callable[[list], list]]]:
    """The dataset's `load` and the loader's `collate_fn` for --decode cpu or gpu."""
    return (encode_region, collate) if decode == "gpu" else (decode_region, None)


def collate(samples: list[tuple]) -> list:
    """Encoded images stay a list (their byte strings differ in length); the rest collates as usual."""
    images, *rest = zip(*samples)
    return [list(images), *(default_collate(list(column)) for column in rest)]


class BatchDecoder:
    """The main process's part: `decoder(batch)` turns a collated batch of EncodedImage into an
    N x size x size x 3 uint8 tensor on `device` (the size the worker asked for), leaving the batch's
    other entries as they are."""

    def __init__(self, device: torch.device, warn: Callable[[str], None]) -> None:
        self.device, self.warn = device, warn
        self.reported: set[str] = set()

    def __call__(self, batch: list) -> list:
        images, *rest = batch
        return [self.decode(images), *rest]

    def decode(self, images: list[EncodedImage]) -> torch.Tensor:
        on_device = iter(self.decode_on_device([im for im in images if im.cpu_reason is None]))
        crops = []
        for im in images:
            pixels = next(on_device) if im.cpu_reason is None else None
            if pixels is not None:
                crops.append(crop_resize(pixels, im.box, im.flip, im.size))
                continue
            reason, crop = im.cpu_reason, im.data
            if reason is None:  # the device decoder refused it; the CPU decoder names a corrupt file
                reason = "a JPEG the device decoder rejected"
                crop = decode_bytes(im.data.numpy().tobytes(), im.path, lambda w, h, im=im: (im.box, im.flip),
                                    im.size)
            self.report(im.path, reason)
            crops.append(crop.to(self.device, non_blocking=True))
        return torch.stack(crops)

    def decode_on_device(self, images: list[EncodedImage]) -> list[Optional[torch.Tensor]]:
        """HWC views of the decoded images, one batched call; None for each image the decoder rejects."""
        if not images:
            return []
        try:
            return [out.permute(1, 2, 0) for out in self.device_decode([im.data for im in images])]
        except OUT_OF_MEMORY:
            raise  # not the images' fault: the CPU path would hide it and starve the GPU
        except RuntimeError:  # one bad image fails the whole call: find it
            pass
        results: list[Optional[torch.Tensor]] = []
        for im in images:
            try:
                results.append(self.device_decode([im.data])[0].permute(1, 2, 0))
            except OUT_OF_MEMORY:
                raise
            except RuntimeError:
                results.append(None)
        return results

    def device_decode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.device.type == "cuda":
            # torchvision allocates the outputs on the current stream but decodes on a stream of its own
            # (pytorch/vision#9606): memory this stream freed but still reads (the previous batch's
            # crops) could be overwritten. Waiting for this stream first closes that window; it holds only
            # the previous batch's decoding (device_batches runs this on its side stream), so it is short.
            torch.cuda.current_stream(self.device).synchronize()
        from torchvision.io import ImageReadMode, decode_jpeg  # imported late: see data.share_heap_with_workers
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)

    def report(self, path: str, reason: str) -> None:
        if reason not in self.reported:
            self.reported.add(reason)
            self.warn(f"--decode gpu: {path} is {reason}; decoded on the CPU instead "
                      "(said once for each kind of image)")
