"""--decode: which process turns a sample's bytes into pixels (cpu: the loader workers; gpu: the training process,
on the device, from the bytes and the random choices the workers drew), for training and validation alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import DataLoader

from imagenet_elastic import options
from imagenet_elastic.data import pipeline, pixels
from imagenet_elastic.data.augment import Augment
from imagenet_elastic.data.device import gpu_decode, jpeg_decoders
from imagenet_elastic.data.resolution import TrainSizes
from imagenet_elastic.data.sampler import TrainBatchSampler
from imagenet_elastic.data.sources import Source
from imagenet_elastic.options import option

CPU_DECODE_CORES = 32  # cores per process from which --decode auto decodes in workers (no policy or erasing)
GPU_DECODE_WORKERS = 4  # loader workers per process under --decode gpu: they do no decoding, so a few feed a GPU

# --decode's modes: what their loader workers do with a sample's bytes (training's, validation's), how they batch
WORKER_PARTS: dict[str, tuple[pipeline.Load, pipeline.EvalLoad, Callable[[list], pipeline.Batch]]] = {
    "cpu": (pixels.decode_bytes, pixels.decode_centre_crop, pipeline.collate),
    "gpu": (gpu_decode.encode_bytes, gpu_decode.encode_centre_crop, gpu_decode.collate),
}


@dataclass(frozen=True)
class DecodeSettings:
    """Where images are decoded and augmented (`Decoding`), with which JPEG library, by how many loader workers."""

    decode: str = option(
        "auto", "cpu: loader workers decode and augment; gpu: workers only read files and draw every random choice, "
        "a thread of the training process decodes each batch on the device (--gpu-decoder) and crops, resizes, "
        "flips, runs the policy and erases it on the GPU, two batches ahead (PNG, CMYK and rejected JPEGs fall "
        "back to the CPU, each kind reported once by each rank that meets it); auto: gpu on CUDA when there is a "
        f"policy or erasing, or fewer than {CPU_DECODE_CORES} cores per process, else cpu (the start-up table says "
        "which and why)", "run", choices=["auto", *WORKER_PARTS])
    gpu_decoder: str = option(
        "auto", "the JPEG library --decode gpu decodes with: " + options.described(jpeg_decoders.JPEG_DECODERS)
        + "; auto: the first of these that decodes on this device (the start-up table says which and why)", "run",
        choices=["auto", *jpeg_decoders.JPEG_DECODERS])
    workers: Optional[int] = option(None, "DataLoader processes per rank", "run", "N",
                                    shown_default="cores per process - 1 (max 8; max 4 under --decode gpu)",
                                    type=options.worker_count)


@dataclass(frozen=True)
class Decoding:
    mode: str  # "cpu" or "gpu"
    why: str = ""  # how the mode was chosen, for the start-up table
    library: str = "torchvision"  # gpu: the JPEG decoder of jpeg_decoders.JPEG_DECODERS
    library_why: str = ""
    cores_per_process: int = 0  # gpu: the library's host threads are what the loader workers leave of these
    unused: str = ""  # cpu: a --gpu-decoder the command line named, which this mode leaves unused

    @classmethod
    def choose(cls, requested: str, device: torch.device, cores_per_process: int, augment: Augment,
               gpu_decoder: str = "auto") -> Decoding:
        """--decode as asked; `auto`: gpu on CUDA with a policy or erasing (on the device a few operators per batch,
        in the workers a pass over every image) or fewer than CPU_DECODE_CORES cores per process; else cpu."""
        if requested != "auto":
            mode, why = requested, f"--decode {requested}"
        elif device.type != "cuda":
            mode, why = "cpu", "auto: no CUDA device"
        elif augment.after_crop:
            mode, why = "gpu", "auto: CUDA, with a policy or erasing to run"
        elif cores_per_process < CPU_DECODE_CORES:
            mode, why = "gpu", f"auto: CUDA, {cores_per_process} cores per process (< {CPU_DECODE_CORES})"
        else:
            mode = "cpu"
            why = f"auto: CUDA, {cores_per_process} cores per process (>= {CPU_DECODE_CORES}) and no policy"
        if mode == "cpu":
            return cls(mode, why, unused=gpu_decoder if gpu_decoder != "auto" else "")
        library, library_why = jpeg_decoders.choose(gpu_decoder, device)
        return cls(mode, why, library, library_why, cores_per_process)

    def default_workers(self, cores: int, local_world_size: int) -> int:
        """Loader workers per process when --workers does not say (pipeline.default_workers, fewer under gpu)."""
        workers = pipeline.default_workers(cores, local_world_size)
        return min(workers, GPU_DECODE_WORKERS) if self.mode == "gpu" else workers

    def feed(self, device: torch.device, workers: Optional[int], cores: int, local_world_size: int, batch_size: int,
             largest_crop: int, warn: Callable[[str], None]) -> Feed:
        """This decoding set up here: loader workers (--workers, else this mode's default), how far ahead each reads
        (pinned batches of `batch_size` at `largest_crop` within budget), what finishes each batch on the device."""
        workers = workers if workers is not None else self.default_workers(cores, local_world_size)
        pinned = device.type == "cuda"
        batch = pipeline.batch_bytes(batch_size, largest_crop, encoded=self.mode == "gpu")
        return Feed(self, workers, pipeline.prefetch_factor(workers, batch, pinned), pinned,
                    self.finisher(device, warn, workers))

    def finisher(self, device: torch.device, warn: Callable[[str], None], workers: int
                 ) -> Optional[gpu_decode.BatchDecoder]:
        """What the training process does with a batch before it trains on it (None: nothing)."""
        if self.mode != "gpu":
            return None
        return gpu_decode.BatchDecoder(device, warn, jpeg_decoders.JPEG_DECODERS[self.library].make(
            device, self.library_threads(workers)))

    def library_threads(self, workers: int) -> int:
        """Host threads the JPEG library may decode on: the cores less the loader workers and the training thread, at
        least one (more would starve the workers that feed it)."""
        return max(1, self.cores_per_process - workers - 1)

    def warning(self, device: torch.device) -> Optional[str]:
        """What to say at start about this mode on this device."""
        if self.unused:
            return f"--gpu-decoder {self.unused} is not used: images are decoded in the loader workers ({self.why})"
        if self.mode == "gpu" and device.type != "cuda":
            return ("--decode gpu without a CUDA device: the main process decodes each batch on the CPU (slower than "
                    "--decode cpu; meant for testing)")
        return None

    def saved(self) -> dict[str, str]:
        """What a checkpoint keeps: how its pixels were made (other ways give pixels up to a level apart)."""
        return {"decode": self.mode, **({"gpu_decoder": self.library} if self.mode == "gpu" else {})}

    def change_from(self, saved: Optional[dict[str, str]]) -> Optional[str]:
        """How this run decodes differently from the checkpoint's run it resumes (`saved`), or None (--decode auto
        may choose otherwise on another node)."""
        now = self.saved()
        if not saved or saved == now:
            return None
        asked = f"--decode {saved['decode']}" + (f" --gpu-decoder {saved['gpu_decoder']}" if "gpu_decoder" in saved
                                                 else "")
        return (f"decoding: checkpoint {way(saved)}, now {way(now)} (pixels up to a level apart; {asked} decodes "
                "as it did)")

    def describe(self, device: torch.device, augment: Augment) -> str:
        """The start-up table's line."""
        chosen = f" ({self.why})" if self.why else ""
        if self.mode == "cpu":
            return "in loader workers" + chosen
        return (f"batched on {device}{chosen} by {self.library} ({self.library_why})"
                + (", then the policy and erasing there" if augment.after_crop else ""))


@dataclass(frozen=True)
class Feed:
    """A Decoding set up on this machine (`Decoding.feed`): the loaders it makes and what finishes their batches."""

    decoding: Decoding
    workers: int
    prefetch: int  # batches each worker prepares ahead (pipeline.prefetch_factor)
    pinned: bool  # on CUDA: the loaders pin their batches, within pipeline.PINNED_BUDGET
    decoder: Optional[gpu_decode.BatchDecoder]  # --decode gpu: finishes each batch on the device

    def train_loader(self, source: Source, sizes: TrainSizes, seed: int, augment: Augment,
                     sampler: TrainBatchSampler, ignored: tuple[int, ...] = ()) -> DataLoader:
        load, _, collate = WORKER_PARTS[self.decoding.mode]
        dataset = pipeline.TrainDataset(source, sizes, seed, load, augment)
        return pipeline.train_loader(dataset, sampler, self.workers, self.pinned, ignored, collate, self.prefetch)

    def eval_loader(self, source: Source, crop: int, resize: int, batch_size: int, rank: int, world_size: int,
                    ignored: tuple[int, ...] = (), interpolation: str = "bilinear") -> DataLoader:
        _, load, collate = WORKER_PARTS[self.decoding.mode]
        dataset = pipeline.EvalDataset(source, crop, resize, load, interpolation)
        return pipeline.eval_loader(dataset, batch_size, rank, world_size, self.workers, self.pinned, ignored,
                                    collate, self.prefetch)


def way(saved: dict[str, str]) -> str:
    """A Decoding.saved() in words: `gpu by nvimgcodec`, `cpu`."""
    return f"{saved['decode']} by {saved['gpu_decoder']}" if "gpu_decoder" in saved else saved["decode"]
