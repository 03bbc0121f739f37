"""--gpu-decoder: the library that decodes a batch of JPEG bytes on the device under --decode gpu (a new one: a class
here and a line in `JPEG_DECODERS`). Both leave their images on the calling thread's current stream in torch's caching
allocator (its counters, out-of-memory retry and `empty_cache` see them), run on CPU tensors too, and hold the calling
thread: torchvision until the device decoded, nvImageCodec until its host share is done."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import NamedTuple, Optional, Protocol

import numpy as np
import torch
from PIL import Image

from imagenet_elastic.data.device import streams
from imagenet_elastic.errors import UserError, first_line


def device_index(device: torch.device) -> int:
    """The CUDA device's number (`cuda` alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


class JpegDecoder(Protocol):
    def decode(self, data: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """JPEG bytes (1-D uint8 on the host) -> C x H x W uint8 RGB on the device, any dense layout; None: rejected."""


class TorchvisionJpeg:
    """torchvision's `decode_jpeg` (nvJPEG on CUDA, libjpeg-turbo on the CPU)."""

    def __init__(self, device: torch.device, cpu_threads: int = 0) -> None:
        self.device = device
        # torchvision allocates nvJPEG's outputs on the current stream but writes them from a pooled stream that does
        # not wait for it (pytorch/vision#9606), so memory freed meanwhile could be written over: the outputs get a
        # high-priority stream of their own (shared only with the feeding and decoding streams; NCCL's pooled ones are
        # normal), each decode first waits (blocking) for what is queued on it, and they are kept until read (Held).
        self.alloc_stream = torch.cuda.Stream(device, priority=-1) if streams.on_cuda(device) else None

    def decode(self, data: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        try:
            return list(self.batch(data))
        except RuntimeError as error:  # one bad image fails the whole call: find it, unless the device is full
            raise_if_out_of_memory(error, len(data))
        results: list[Optional[torch.Tensor]] = []
        for one in data:
            try:
                results.append(self.batch([one])[0])
            except RuntimeError as error:
                raise_if_out_of_memory(error, 1)
                results.append(None)
        return results

    def batch(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """One batched call; raises RuntimeError if any image fails."""
        from torchvision.io import ImageReadMode, decode_jpeg  # imported late: see pipeline.share_heap_with_workers

        if self.alloc_stream is None:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        self.alloc_stream.record_event(torch.cuda.Event(blocking=True)).synchronize()  # what is queued on it, done
        with torch.cuda.stream(self.alloc_stream):  # torchvision makes this stream wait for its decode
            decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        torch.cuda.current_stream(self.device).wait_stream(self.alloc_stream)
        return decoded


class NvImageCodecJpeg:
    """nvImageCodec's batched decoder: on CUDA its GPU backends (nvJPEG with libjpeg-turbo's chroma upsampling, the
    hardware JPEG engines where present), on the CPU libjpeg-turbo; a rejected image is None (no second pass). It
    decodes into one tensor from torch: left to itself it takes each image from CUDA's default pool (cudaMallocAsync),
    which torch's counters and `empty_cache` cannot see, and which gives memory back at every synchronisation."""

    def __init__(self, device: torch.device, cpu_threads: int = 0, backends: Optional[tuple[str, ...]] = None,
                 options: str = "") -> None:
        """`backends`: on CUDA, the library's backend kinds by name (None: all); `options`: more decoder options.
        Both are left to the library in training; bench/gpu_decoder_settings.py tries others."""
        self.device, self.cpu_threads, self.backends, self.options = device, cpu_threads, backends, options
        self.on_gpu = device.type == "cuda"
        self.decoder = self.params = None  # made at the first batch: its thread pool must not exist when workers fork

    def decode(self, data: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        nvimgcodec = import_nvimgcodec()
        if self.decoder is None:
            kinds = self.backends if self.on_gpu else ("CPU_ONLY",)
            self.decoder = nvimgcodec.Decoder(
                device_id=device_index(self.device) if self.on_gpu else nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                max_num_cpu_threads=self.cpu_threads,
                backends=None if kinds is None else [nvimgcodec.Backend(getattr(nvimgcodec, kind)) for kind in kinds],
                # libjpeg-turbo's chroma upsampling (the CPU path's pixels), said: 0.8 defaulted it off, 0.9 on
                options=" ".join([":fancy_upsampling=1", self.options]).strip())
            # pixels as stored: the CPU path, decode_jpeg and the worker's crop box all ignore the EXIF orientation
            self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False)
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.on_gpu else 0
        headers = [parsed(nvimgcodec, d) for d in data]  # None: a header it cannot read
        kept = [i for i, header in enumerate(headers) if header is not None]
        sizes = [headers[i][1:] for i in kept]
        try:
            whole = torch.empty(sum(h * w * 3 for h, w in sizes), dtype=torch.uint8, device=self.device)
            into = [view.view(h, w, 3) for view, (h, w) in zip(whole.split([h * w * 3 for h, w in sizes]), sizes)]
            # the same stream as the decode's, or the library would make the host wait for the images' stream
            targets = [nvimgcodec.as_image(t if self.on_gpu else t.numpy(), cuda_stream=stream) for t in into]
            images = self.decoder.decode([headers[i][0] for i in kept], images=targets, params=self.params,
                                         cuda_stream=stream) if kept else []
        except RuntimeError as error:
            raise_if_out_of_memory(error, len(data))
            raise
        results: list[Optional[torch.Tensor]] = [None] * len(data)
        for i, target, image in zip(kept, into, images):
            if image is not None:  # the library's own memory, should it not have decoded into ours
                results[i] = target if image_address(image) == target.data_ptr() else self.tensor(image)
        # C x H x W over the H x W x C memory as it lies: a view (batch_crops gathers any layout, copying nothing)
        return [None if image is None else image.permute(2, 0, 1) for image in results]

    def tensor(self, image) -> torch.Tensor:
        """The decoded H x W x 3 image as a tensor over nvImageCodec's memory (kept alive by the tensor)."""
        if self.on_gpu:
            return torch.from_dlpack(image)  # on the current stream, which the decode already made wait
        with warnings.catch_warnings():  # read-only: the image is only read (batch_crops copies it)
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.asarray(image))


def parsed(nvimgcodec, data: torch.Tensor) -> Optional[tuple[object, int, int]]:
    """nvImageCodec's code stream of one image's bytes, its height and width; None when it cannot read the header
    (the batch decoder then tries the CPU path, which names a corrupt file)."""
    try:
        stream = nvimgcodec.CodeStream(data.numpy())
        return stream, stream.height, stream.width
    except (RuntimeError, ValueError):
        return None


def image_address(image) -> int:
    """Where an nvImageCodec image's pixels are, on the device or the host."""
    interface = image.__cuda_array_interface__ if image.buffer_kind.name == "STRIDED_DEVICE" else \
        image.__array_interface__
    return interface["data"][0]


# How torchvision's CUDA decoder words a failed allocation inside "Error while decoding JPEG images: ...": torch's
# "CUDA out of memory", nvJPEG's status 5 (NVJPEG_STATUS_ALLOCATOR_FAILURE: "Failed to decode batch: 5"), or CUDA's 2
# (cudaErrorMemoryAllocation) from its stream synchronisation. Corrupt images give other nvJPEG statuses.
_ALLOCATION_FAILED = re.compile(r"Failed to (?!synchronize CUDA stream)[^:\n]*: 5\b"
                                r"|Failed to synchronize CUDA stream: 2\b")


def device_out_of_memory(error: BaseException) -> bool:
    """Whether a failed device decode ran out of memory. torchvision re-throws every failure inside its CUDA
    decoder as a plain RuntimeError ("Error while decoding JPEG images: ..."), so the type alone says nothing."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return "out of memory" in text.lower() or _ALLOCATION_FAILED.search(text) is not None


def raise_if_out_of_memory(error: RuntimeError, images: int) -> None:
    """A full device is not the images' fault: decoding them one by one, then on the CPU, would hide it behind
    a warning about a rejected JPEG and starve the GPU. It stays an out-of-memory error."""
    if device_out_of_memory(error):
        if isinstance(error, torch.OutOfMemoryError):
            raise error
        raise torch.OutOfMemoryError(f"--decode gpu: the device ran out of memory decoding {images} JPEG(s) "
                                     f"({first_line(error)}); try a smaller --batch-size") from error


def import_nvimgcodec():
    """`nvidia.nvimgcodec`, whose import prints a paragraph for each codec library it cannot load (JPEG 2000,
    TIFF: not ours): that text is kept from the console and given back only if the import fails."""
    if sys.modules.get("nvidia.nvimgcodec") is not None:  # imported before: nothing to say, nothing to capture
        return sys.modules["nvidia.nvimgcodec"]
    with captured_output() as text:
        try:
            return importlib.import_module("nvidia.nvimgcodec")
        except ImportError as error:
            failed = error
    raise ImportError(f"{failed}{': ' + text() if text() else ''}") from None  # what it printed, once captured


@contextlib.contextmanager
def captured_output() -> Iterator[Callable[[], str]]:
    """What native code writes to file descriptors 1 and 2 meanwhile, as a function that returns it after."""
    captured = ""
    with tempfile.TemporaryFile() as sink:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        try:
            for fd in saved:
                os.dup2(sink.fileno(), fd)
            yield lambda: captured
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            captured = " ".join(sink.read().decode(errors="replace").split())


def nvimgcodec_unavailable(device: torch.device) -> Optional[str]:
    """Why nvimgcodec cannot decode on `device` here (None: it can): not installed, or installed without the
    libraries its GPU decoder needs, which it otherwise replaces by its CPU decoder without a word."""
    try:
        nvimgcodec = import_nvimgcodec()
    except ImportError:
        return "not installed (pip install 'imagenet-elastic[nvimgcodec]')"
    except OSError as error:
        return f"cannot be loaded: {error}"
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"cannot decode on {device}: no CUDA device"
    tiny = io.BytesIO()  # a JPEG to check that the GPU decoder works on this machine
    Image.new("RGB", (16, 16), (200, 30, 90)).save(tiny, "JPEG")
    with captured_output() as said:
        try:
            gpu = nvimgcodec.Decoder(device_id=device_index(device), max_num_cpu_threads=1,  # a 16 x 16 image
                                     backends=[nvimgcodec.Backend(nvimgcodec.GPU_ONLY),
                                               nvimgcodec.Backend(nvimgcodec.HYBRID_CPU_GPU)])
            decoded = gpu.decode(tiny.getvalue())
        except RuntimeError as error:
            return f"cannot decode on {device}: {error}"
    if decoded is None:
        return (f"cannot decode on {device} ({said() or 'no GPU JPEG decoder'}); pip install nvidia-nvjpeg-cu13 "
                "(or -cu12, as torch's CUDA)")
    return None


class DecoderInfo(NamedTuple):
    make: Callable[..., JpegDecoder]  # (device, cpu_threads) -> the decoder
    unavailable: Callable[[torch.device], Optional[str]]  # why it cannot run on the device, or None
    help: str  # for --gpu-decoder's help


# --gpu-decoder's choices, in auto's order: torchvision supplies more beside a compiled step (docs/BENCHMARKS.md)
JPEG_DECODERS: dict[str, DecoderInfo] = {
    "torchvision": DecoderInfo(TorchvisionJpeg, lambda device: None,
                               "torchvision's nvJPEG decode_jpeg, the faster beside training: 4:2:0 chroma by nearest "
                               "sample, ~0.7 level from the CPU path on photos"),
    "nvimgcodec": DecoderInfo(NvImageCodecJpeg, nvimgcodec_unavailable,
                              "NVIDIA's nvImageCodec, the `nvimgcodec` extra: the CPU path's very pixels"),
}


def choose(requested: str, device: torch.device) -> tuple[str, str]:
    """The library --gpu-decoder names (a UserError if it cannot run here), else the first in JPEG_DECODERS that
    runs on this device; and why, for the start-up table."""
    if requested != "auto":
        reason = JPEG_DECODERS[requested].unavailable(device)
        if reason is not None:
            raise UserError(f"--gpu-decoder {requested}: {reason}")
        return requested, f"--gpu-decoder {requested}"
    passed = []
    for name, info in JPEG_DECODERS.items():
        reason = info.unavailable(device)
        if reason is None:
            return name, "auto" + (f"; {'; '.join(passed)}" if passed else "")
        passed.append(f"{name} {reason}")
    raise AssertionError("torchvision decodes everywhere")
