"""`--decode gpu`: loader workers only read files; the main process decodes whole batches with nvJPEG.

A worker reads the file, parses the header for the size, and draws the crop and flip from the
sample's own random stream, exactly as the CPU path does (pipeline.TrainDataset), so the augmentation
contract holds: the same boxes and flips for the same (seed, epoch, index). It hands over the
bytes and the box. The main process decodes the batch with one batched
`torchvision.io.decode_jpeg(..., device=...)` call, then crops, resizes and flips each image on
the device (`decode_crops`, in a thread of its own: feed.decoded_ahead), then runs the sample's
augmentation policy and erasing there (`augment_images`, in the training thread, on a stream of their
own: feed.SideStream), drawn from a seed the worker took from the sample's stream after the crop and flip.

Validation batches take the same way with the reference's view of each image (pixels.CentreCrop) instead of a
random crop: nvJPEG's decode of the whole image, resized in float32 and rounded, then centre-cropped. These are
the CPU path's pixels within a few levels (nvJPEG's IDCT is not libjpeg-turbo's, the float resize rounds within
one level of the uint8 kernel): not bit for bit timm's, which `--decode cpu` is within rounding.

Images nvJPEG cannot take are decoded on the CPU instead, and each reason is reported once:
PNGs and other formats, and CMYK/YCCK JPEGs, are recognised from the header by the worker, which
decodes them itself; a JPEG that the device decoder rejects is decoded in the main process. A device
out of memory is not the images' fault and stays an out-of-memory error (`raise_if_out_of_memory`).
A file that neither can decode is a CorruptImageError naming it, as on the CPU path.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch
from PIL import Image

from imagenet_elastic.data.augment import INCEPTION_CROP, Augment
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.pixels import (
    DECODED_BY_TORCHVISION,
    Box,
    CentreCrop,
    ChooseCrop,
    byte_tensor,
    crop_region,
    crop_resize,
    decode_bytes,
    decode_centre_crop,
    resize_regions,
)
from imagenet_elastic.errors import CorruptImageError, first_line

DEVICE_DECODABLE_MODES = DECODED_BY_TORCHVISION  # JPEG colour modes nvJPEG turns into RGB

OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError: 2.5+
EMPTY = torch.empty(0, dtype=torch.uint8)


@dataclass
class EncodedImage:
    """One image as a worker hands it over: its bytes and where to crop, or (`cpu_reason` set) its
    pixels already decoded and cropped on the CPU."""

    path: str  # the sample's name, for messages
    data: torch.Tensor  # 1-D uint8 file bytes, or size x size x 3 uint8 pixels
    box: Box
    flip: bool
    size: int  # of the square crop the batch wants (train and val sizes may differ)
    cpu_reason: Optional[str] = None
    augment_seed: Optional[int] = None  # the policy's and erasing's draws (augment.Augment.draw_seed)
    centre: Optional[CentreCrop] = None  # validation: this view of the whole image instead of `box` and `flip`

    def decode_on_cpu(self, raw: bytes) -> torch.Tensor:
        """The worker path's pixels of these bytes."""
        if self.centre is not None:
            return decode_centre_crop(raw, self.path, self.centre)
        return decode_bytes(raw, self.path, lambda w, h: (self.box, self.flip), self.size)

    def finish(self, pixels: torch.Tensor) -> torch.Tensor:
        """Decoded HWC pixels (on the device) to this image's crop, one image alone."""
        if self.centre is not None:
            return self.centre.apply(pixels)
        return crop_resize(pixels, self.box, self.flip, self.size)


def read_header(raw: bytes, path: str) -> tuple[int, int, Optional[str]]:
    """Width, height, and why the device cannot decode the image (None: it can)."""
    try:
        with Image.open(io.BytesIO(raw)) as img:
            width, height = img.size
            kind, mode = img.format, img.mode
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise CorruptImageError(f"cannot decode image file {path}: {error}") from None
    if kind == "JPEG" and mode in DEVICE_DECODABLE_MODES:
        return width, height, None
    return width, height, f"a {mode} JPEG" if kind == "JPEG" else f"a {kind} file"


def encode_bytes(raw: bytes, path: str, choose_crop: ChooseCrop, size: int) -> EncodedImage:
    """The worker's part: parse the header, draw the crop (a pipeline.Load, as pixels.decode_bytes is)."""
    width, height, reason = read_header(raw, path)
    box, flip = choose_crop(width, height)
    image = EncodedImage(path, byte_tensor(raw), box, flip, size, reason)
    return image if reason is None else replace(image, data=image.decode_on_cpu(raw))


def encode_centre_crop(raw: bytes, path: str, view: CentreCrop) -> EncodedImage:
    """Validation's worker part (a pipeline.EvalLoad, as pixels.decode_centre_crop is): the bytes, and the view
    the device takes of the whole decoded image."""
    width, height, reason = read_header(raw, path)
    image = EncodedImage(path, byte_tensor(raw), (0.0, 0.0, float(width), float(height)), False, view.size, reason,
                         centre=view)
    return image if reason is None else replace(image, data=image.decode_on_cpu(raw))


@dataclass
class EncodedBatch:
    """A batch's images as they cross from the worker: every image's bytes (or fallback pixels) back to back
    in one uint8 tensor, so the batch is one shared-memory segment, not one (and a socket round trip) per
    image (docs/BENCHMARKS.md); the images keep everything else."""

    data: torch.Tensor  # 1-D uint8
    shapes: list[tuple[int, ...]]  # each image's `data` shape, in order
    images: list[EncodedImage]  # `data` left empty

    @classmethod
    def pack(cls, images: Sequence[EncodedImage]) -> EncodedBatch:
        data = torch.cat([im.data.reshape(-1) for im in images]) if images else EMPTY
        return cls(data, [tuple(im.data.shape) for im in images],
                   [replace(im, data=EMPTY) for im in images])

    def unpack(self) -> list[EncodedImage]:
        """The images again, each `data` a view into the batch's tensor (no copy)."""
        images, start = [], 0
        for im, shape in zip(self.images, self.shapes):
            end = start + math.prod(shape)
            images.append(replace(im, data=self.data[start:end].view(shape)))
            start = end
        return images

    def pin_memory(self) -> EncodedBatch:
        """What DataLoader's pin_memory thread calls on a batch type of its own: the one tensor, pinned."""
        return replace(self, data=self.data.pin_memory())


def collate(samples: list[tuple]) -> Batch:
    """Encoded images become one EncodedBatch (their byte strings differ in length)."""
    images, labels, *indices = zip(*samples)
    return Batch(EncodedBatch.pack(images), torch.tensor(labels, dtype=torch.int64),
                 torch.tensor(indices[0], dtype=torch.int64) if indices else None)


# How torchvision's CUDA decoder words an allocation that failed, inside its "Error while decoding JPEG
# images: ...": torch's allocator ("CUDA out of memory. Tried to allocate ..."), nvJPEG's status 5
# (NVJPEG_STATUS_ALLOCATOR_FAILURE) after one of its calls ("Failed to decode batch: 5"), or CUDA's 2
# (cudaErrorMemoryAllocation) from its stream synchronisation. Corrupt images give other nvJPEG statuses.
_ALLOCATION_FAILED = re.compile(r"Failed to (?!synchronize CUDA stream)[^:\n]*: 5\b"
                                r"|Failed to synchronize CUDA stream: 2\b")


def device_out_of_memory(error: BaseException) -> bool:
    """Whether a failed device decode ran out of memory. torchvision re-throws every failure inside its CUDA
    decoder as a plain RuntimeError ("Error while decoding JPEG images: ..."), so the type alone says nothing."""
    if isinstance(error, OUT_OF_MEMORY):
        return True
    text = str(error)
    return "out of memory" in text.lower() or _ALLOCATION_FAILED.search(text) is not None


def raise_if_out_of_memory(error: RuntimeError, images: int) -> None:
    """A full device is not the images' fault: decoding them one by one, then on the CPU, would hide it behind
    a warning about a rejected JPEG and starve the GPU. It stays an out-of-memory error."""
    if device_out_of_memory(error):
        if isinstance(error, OUT_OF_MEMORY):
            raise error
        raise OUT_OF_MEMORY(f"--decode gpu: the device ran out of memory decoding {images} JPEG(s) with nvJPEG "
                            f"({first_line(error)}); try a smaller --batch-size") from error


class BatchDecoder:
    """The main process's part: `decoder(batch)` turns a Batch of an EncodedBatch into one of an
    N x size x size x 3 uint8 tensor on `device` (the size the worker asked for), labels and indices as they
    are."""

    def __init__(self, device: torch.device, warn: Callable[[str], None], augment: Augment = INCEPTION_CROP) -> None:
        self.device, self.warn, self.augment = device, warn, augment
        self.batched_crops = device.type != "cpu"  # the CPU has a uint8 resize kernel: the worker path's pixels
        self.reported: set[str] = set()

    def __call__(self, batch: Batch) -> Batch:
        """All of it, in the calling thread (the benchmark's and the tests' way)."""
        return self.augment_images(*self.decode_crops(batch))

    def decode_crops(self, batch: Batch) -> tuple[Batch, list[Optional[int]]]:
        """The batch with its crops (N x size x size x 3 uint8 on the device) before the policy, and each image's
        policy seed. Draws nothing at random, so it may run in a thread of its own (feed.device_batches)."""
        images = batch.images.unpack()
        return replace(batch, images=self.decode(images)), [im.augment_seed for im in images]

    @staticmethod
    def draws_policy(seeds: list[Optional[int]]) -> bool:
        """Whether `augment_images` runs the policy or erasing on any image."""
        return any(seed is not None for seed in seeds)

    def augment_images(self, batch: Batch, seeds: list[Optional[int]]) -> Batch:
        """`decode_crops`' output with the policy and erasing applied, image by image (torchvision's draw per
        image), in the thread that owns torch's global generator: the training thread (on a stream of its
        own: feed.device_batches). Each image is written back into the batch, which is this batch's own
        tensor (`decode` stacked it)."""
        for image, seed in zip(batch.images, seeds):
            if seed is not None:
                image.copy_(self.augment.apply(image, seed, pil=False))
        return batch

    def decode(self, images: list[EncodedImage]) -> torch.Tensor:
        on_device = iter(self.decode_on_device([im for im in images if im.cpu_reason is None]))
        crops: list[Optional[torch.Tensor]] = [None] * len(images)
        decoded: list[tuple[int, torch.Tensor]] = []  # (position, pixels) of those the device decoded
        for i, im in enumerate(images):
            pixels = next(on_device) if im.cpu_reason is None else None
            if pixels is not None:
                decoded.append((i, pixels))  # cropped below, with the batch's others
                continue
            reason, crop = im.cpu_reason, im.data
            if reason is None:  # the device decoder refused it; the CPU decoder names a corrupt file
                reason = "a JPEG the device decoder rejected"
                crop = im.decode_on_cpu(im.data.numpy().tobytes())
            self.report(im.path, reason)
            crops[i] = crop.to(self.device, non_blocking=True)
        for (i, _), crop in zip(decoded, self.crop([pixels for _, pixels in decoded], [images[i] for i, _ in decoded])):
            crops[i] = crop
        return torch.stack(crops)

    def crop(self, decoded: list[torch.Tensor], images: list[EncodedImage]) -> list[torch.Tensor]:
        """Each decoded image's crop, resized and flipped: HWC uint8. On the CPU (tests) with the worker
        path's uint8 kernel, image by image; elsewhere batched (pixels.resize_regions). Validation's
        (pixels.CentreCrop) image by image, each whole image resized as the reference resizes it."""
        if not self.batched_crops or any(im.centre is not None for im in images):
            return [im.finish(pixels) for pixels, im in zip(decoded, images)]
        if not decoded:
            return []
        regions = [crop_region(pixels, im.box) for pixels, im in zip(decoded, images)]
        return list(resize_regions(regions, [im.flip for im in images], images[0].size))

    def decode_on_device(self, images: list[EncodedImage]) -> list[Optional[torch.Tensor]]:
        """HWC views of the decoded images, one batched call; None for each image the decoder rejects."""
        if not images:
            return []
        try:
            return [out.permute(1, 2, 0) for out in self.device_decode([im.data for im in images])]
        except RuntimeError as error:  # one bad image fails the whole call: find it, unless the device is full
            raise_if_out_of_memory(error, len(images))
        results: list[Optional[torch.Tensor]] = []
        for im in images:
            try:
                results.append(self.device_decode([im.data])[0].permute(1, 2, 0))
            except RuntimeError as error:
                raise_if_out_of_memory(error, 1)
                results.append(None)
        return results

    def device_decode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.device.type == "cuda":
            # torchvision allocates the outputs on the current stream but decodes on a stream of its own
            # (pytorch/vision#9606): memory this stream freed but still reads (the previous batch's
            # crops) could be overwritten. Waiting for this stream first closes that window; it holds only
            # the previous batch's decoding (device_batches runs this on its side stream), so it is short.
            torch.cuda.current_stream(self.device).synchronize()
        from torchvision.io import ImageReadMode, decode_jpeg  # imported late: see pipeline.share_heap_with_workers
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)

    def report(self, path: str, reason: str) -> None:
        if reason not in self.reported:
            self.reported.add(reason)
            self.warn(f"--decode gpu: {path} is {reason}; decoded on the CPU instead "
                      "(said once for each kind of image)")
