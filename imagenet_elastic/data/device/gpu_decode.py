"""`--decode gpu`: a loader worker parses the header and draws the crop, flip, policy and erasing as the CPU path does
and hands over the bytes and those numbers (`EncodedBatch`); the training process decodes, crops (batch_crops.py) and
augments (batch_policy.py) whole batches, validation's too (pixels.CentreCrop in float32, rounded). Images the device
cannot take are decoded on the CPU, each reason reported once: PNGs, other formats and CMYK/YCCK JPEGs by the worker,
a JPEG the device rejects by the training process; a file neither decodes is a CorruptImageError naming it."""

from __future__ import annotations

import collections
import functools
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from PIL import Image

from imagenet_elastic.data import pipeline, pixels
from imagenet_elastic.data.augment import Augment, Draws
from imagenet_elastic.data.device import batch_crops, jpeg_decoders, streams
from imagenet_elastic.data.device.batch_policy import PolicyPlan
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.pixels import Box, CentreCrop, ChooseCrop, byte_tensor


@dataclass
class EncodedImage:
    """One image from a worker: its bytes and every choice drawn for it, or (`cpu_reason`) its CPU-decoded crop."""

    path: str  # the sample's name, for messages
    data: torch.Tensor  # 1-D uint8 file bytes, or size x size x 3 uint8 pixels
    box: Box
    flip: bool
    size: int  # of the square crop the batch wants (train and val sizes may differ)
    width: int  # the image's, from its header
    height: int
    cpu_reason: Optional[str] = None
    augment_seed: Optional[int] = None  # the seed of the policy's and erasing's draws (augment.Augment.draw_seed)
    draws: Optional[Draws] = None  # what they drew
    centre: Optional[CentreCrop] = None  # validation: this view of the whole image instead of `box` and `flip`

    def view(self) -> list[float]:
        """The device's row of numbers for this image's crop (batch_crops.VIEW_FIELDS)."""
        if self.centre is not None:
            return batch_crops.centre_view(self.centre, self.width, self.height)
        return batch_crops.train_view(self.box, self.flip, self.width, self.height, self.size)

    def augmented(self, augment: Augment, seed: Optional[int]) -> EncodedImage:
        """With the draws of its policy and erasing (pipeline.TrainDataset), which the device applies to the batch."""
        return self if seed is None else replace(self, augment_seed=seed, draws=augment.draws(seed, self.size))


def cpu_pixels(raw: bytes, path: str, box: Box, flip: bool, size: int, centre: Optional[CentreCrop]) -> torch.Tensor:
    """The worker path's pixels of an image's bytes (before the policy): validation's `centre`, else the crop."""
    if centre is not None:
        return pixels.decode_centre_crop(raw, path, centre)
    return pixels.decode_bytes(raw, path, lambda w, h: (box, flip), size)


def encode_bytes(raw: bytes, path: str, choose_crop: ChooseCrop, size: int,
                 centre: Optional[CentreCrop] = None) -> EncodedImage:
    """The worker's part (a pipeline.Load): the bytes and the crop `choose_crop` draws from the header's size; an
    image the device cannot decode (not a JPEG in RGB or grey, as nvJPEG needs) is decoded here instead."""
    with pixels.decoding(path), Image.open(io.BytesIO(raw)) as img:
        width, height = img.size
        kind, mode = img.format, img.mode
    reason = None
    if kind != "JPEG" or mode not in pixels.DECODED_BY_TORCHVISION:
        reason = f"a {mode} JPEG" if kind == "JPEG" else f"a {kind} file"
    box, flip = choose_crop(width, height)
    data = byte_tensor(raw) if reason is None else cpu_pixels(raw, path, box, flip, size, centre)
    return EncodedImage(path, data, box, flip, size, width, height, reason, centre=centre)


def encode_centre_crop(raw: bytes, path: str, view: CentreCrop) -> EncodedImage:
    """Validation's worker part (a pipeline.EvalLoad): the bytes, and the view the device takes of the image."""
    return encode_bytes(raw, path, lambda w, h: ((0.0, 0.0, float(w), float(h)), False), view.size, view)


@dataclass
class EncodedBatch:
    """A batch's images as they cross from the worker, in columns: all bytes (or fallback pixels) in one uint8 tensor,
    one shared-memory segment rather than one (and a socket round trip) per image (docs/BENCHMARKS.md)."""

    data: torch.Tensor  # 1-D uint8
    lengths: list[int]  # each image's share of `data`, in order
    paths: list[str]
    fallbacks: dict[int, str]  # position -> why the worker decoded it (its `data` is then size x size x 3 pixels)
    views: torch.Tensor  # N x batch_crops.VIEW_FIELDS float32
    size: int
    interpolation: str  # the resize's filter: training's bilinear, or validation's CentreCrop's
    policy: Optional[PolicyPlan]
    crops: list[tuple[Box, bool]]  # the boxes and flips as drawn: a JPEG the device rejects is decoded with them
    centre: Optional[CentreCrop]  # validation's view of every image

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def pack(cls, images: Sequence[EncodedImage]) -> EncodedBatch:
        size, centre = images[0].size, images[0].centre
        if any(im.size != size for im in images):  # a batch comes from one epoch: its size is the epoch's
            raise ValueError(f"one batch, several crop sizes: {sorted({im.size for im in images})}")
        return cls(torch.cat([im.data.reshape(-1) for im in images]), [im.data.numel() for im in images],
                   [im.path for im in images], {i: im.cpu_reason for i, im in enumerate(images) if im.cpu_reason},
                   torch.tensor([im.view() for im in images], dtype=torch.float32), size,
                   centre.interpolation if centre is not None else "bilinear",
                   PolicyPlan.pack([im.draws for im in images], size), [(im.box, im.flip) for im in images], centre)

    def pieces(self) -> Sequence[torch.Tensor]:
        """Each image's bytes (or fallback pixels, flattened): views into `data`, no copy."""
        return torch.split(self.data, self.lengths)

    def pin_memory(self) -> EncodedBatch:
        """Every tensor pinned (for DataLoader's pin_memory thread), so each reaches the device without waiting."""
        return replace(self, data=self.data.pin_memory(), views=self.views.pin_memory(),
                       policy=self.policy.pin_memory() if self.policy is not None else None)


collate = functools.partial(pipeline.collate, join=EncodedBatch.pack)  # one EncodedBatch: the bytes differ in length


class BatchDecoder:
    """The training process's part: a Batch of an EncodedBatch to N x size x size x 3 uint8 on `device`, cropped and
    augmented as drawn. It draws nothing at random, so it runs beside the training thread in two halves."""

    def __init__(self, device: torch.device, warn: Callable[[str], None],
                 jpeg: Optional[jpeg_decoders.JpegDecoder] = None) -> None:
        self.device, self.warn = device, warn
        self.jpeg = jpeg if jpeg is not None else jpeg_decoders.TorchvisionJpeg(device)  # --gpu-decoder's library
        self.reported: set[str] = set()
        self.held = Held()  # the decoded images, until the kernels that read them have run

    def __call__(self, batch: Batch) -> Batch:
        return self.finished(self.decoded(batch))

    def decoded(self, batch: Batch) -> tuple[Batch, list[Optional[torch.Tensor]]]:
        """The first half: the batch, and its device's JPEGs decoded by one call; touches nothing `finished` does."""
        encoded: EncodedBatch = batch.images
        pieces = encoded.pieces()
        return batch, self.decode_on_device([pieces[i] for i in device_decodable(encoded)])

    def finished(self, decoded: tuple[Batch, list[Optional[torch.Tensor]]]) -> Batch:
        """The second half: `decoded`'s images cropped, augmented and erased, the labels on the device."""
        batch, images = decoded
        encoded: EncodedBatch = batch.images
        crops = self.crops(encoded, images)
        if encoded.policy is not None:
            encoded.policy.to(self.device).apply(crops)
        return Batch(crops, batch.labels.to(self.device, non_blocking=True), batch.indices)

    def crops(self, encoded: EncodedBatch, decoded: Optional[list[Optional[torch.Tensor]]] = None) -> torch.Tensor:
        """N x size x size x 3 uint8 on the device, decoded (by the CPU path where the device cannot) and cropped."""
        self.held.release_finished()
        pieces, fallbacks = encoded.pieces(), dict(encoded.fallbacks)
        wanted = device_decodable(encoded)
        if decoded is None:
            decoded = self.decode_on_device([pieces[i] for i in wanted])
        cpu = {i: pieces[i].view(encoded.size, encoded.size, 3) for i in fallbacks}  # as the worker decoded them
        for i, image in zip(wanted, decoded):
            if image is None:  # the device decoder refused it; the CPU decoder names a corrupt file
                fallbacks[i] = "a JPEG the device decoder rejected"
                cpu[i] = cpu_pixels(pieces[i].numpy().tobytes(), encoded.paths[i], *encoded.crops[i], encoded.size,
                                    encoded.centre)
        for i in sorted(fallbacks):
            self.report(encoded.paths[i], fallbacks[i])
        images = [image for image in decoded if image is not None]
        views = encoded.views.to(self.device, non_blocking=True)
        if not cpu:
            crops = batch_crops.crop_resize(images, views, encoded.size, encoded.interpolation)
            self.hold(images)
            return crops
        out = torch.empty((len(encoded), encoded.size, encoded.size, 3), dtype=torch.uint8, device=self.device)
        if images:
            rows = self.index([i for i in range(len(encoded)) if i not in cpu])
            out.index_copy_(0, rows, batch_crops.crop_resize(images, views.index_select(0, rows), encoded.size,
                                                              encoded.interpolation))
            self.hold(images)
        cpu_rows = sorted(cpu)
        worker_pixels = torch.stack([cpu[i] for i in cpu_rows])
        out.index_copy_(0, self.index(cpu_rows), batch_crops.to_device(worker_pixels, self.device))
        return out

    def hold(self, decoded: list[torch.Tensor]) -> None:
        """On CUDA, keep the decoder's outputs until the kernels just queued to read them have run (freed sooner, the
        next decode could write over them); the event blocks rather than spin a core beside the loader workers."""
        if streams.on_cuda(self.device):
            read = torch.cuda.current_stream(self.device).record_event(torch.cuda.Event(blocking=True))
            self.held.keep(decoded, read)

    def index(self, rows: list[int]) -> torch.Tensor:
        return batch_crops.to_device(torch.tensor(rows, dtype=torch.int64), self.device)

    def decode_on_device(self, images: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """The decoded images (C x H x W uint8, the library's layout), one batched call; None where rejected."""
        return self.jpeg.decode(images) if images else []

    def report(self, path: str, reason: str) -> None:
        if reason not in self.reported:
            self.reported.add(reason)
            self.warn(f"--decode gpu: {path} is {reason}; decoded on the CPU instead "
                      "(said once for each kind of image)")


def device_decodable(encoded: EncodedBatch) -> list[int]:
    """The positions of the images the device decodes: those the worker did not decode itself."""
    return [i for i in range(len(encoded)) if i not in encoded.fallbacks]


class Held:
    """Device tensors kept until an event recorded after the kernels that read them says those ran. Past `limit`
    batches the oldest is waited for: the cropping thread is then that far ahead, and memory must not grow unbounded."""

    def __init__(self, limit: int = 4) -> None:
        self.limit = limit
        self.batches: collections.deque[tuple[Any, list[torch.Tensor]]] = collections.deque()

    def keep(self, tensors: list[torch.Tensor], event: Any) -> None:
        self.batches.append((event, tensors))
        while len(self.batches) > self.limit:
            event, _ = self.batches.popleft()  # the tensors (`_`) outlive the wait
            event.synchronize()

    def release_finished(self) -> None:
        while self.batches and self.batches[0][0].query():
            self.batches.popleft()
