"""A source's samples to uint8 batches: datasets, the batch type, loaders and their workers. Workers hand over HWC
uint8 (under --decode gpu, the bytes), made float and normalised on the device. Every random choice of a training
sample comes from (seed, epoch, sample index) alone, so a restart, any worker count and any world size agree."""

from __future__ import annotations

import dataclasses
import functools
import gc
import multiprocessing
import random
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Union

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from imagenet_elastic.data import pixels
from imagenet_elastic.data.augment import INCEPTION_CROP, Augment
from imagenet_elastic.data.resolution import TrainSizes
from imagenet_elastic.data.sampler import SampleKey, TrainBatchSampler, eval_shard
from imagenet_elastic.data.sources import Source

# A worker's part (pixels.decode_bytes, gpu_decode.encode_bytes): (bytes, the sample's name for errors, ...) -> image
Load = Callable[[bytes, str, pixels.ChooseCrop, int], Any]
EvalLoad = Callable[[bytes, str, pixels.CentreCrop], Any]


@dataclasses.dataclass
class Batch:
    """One micro-batch, as a loader hands it over and a training step takes it."""

    images: Any  # N x H x W x 3 uint8; under --decode gpu an EncodedBatch until the device decodes it
    labels: torch.Tensor  # int64 class indices
    indices: Optional[torch.Tensor] = None  # training: the samples' indices, kept on the host (sample log)

    def __len__(self) -> int:
        return len(self.labels)

    def part(self, where: slice) -> Batch:
        """The images at `where` (a view), with their labels and indices; the whole batch is itself."""
        if (where.start, where.stop) == (0, len(self)):
            return self
        return dataclasses.replace(self, images=self.images[where], labels=self.labels[where],
                                   indices=None if self.indices is None else self.indices[where])

    def pin_memory(self) -> Batch:
        """What DataLoader's pin_memory thread calls on a batch type of its own."""
        return dataclasses.replace(self, images=self.images.pin_memory(), labels=self.labels.pin_memory())

    def to(self, device: torch.device) -> Batch:
        """Images and labels on `device`, without waiting (from pinned memory); indices stay on the host."""
        return dataclasses.replace(self, images=self.images.to(device, non_blocking=True),
                                   labels=self.labels.to(device, non_blocking=True))


def collate(samples: list[tuple], join: Callable[[list], Any] = default_collate) -> Batch:
    """Dataset items (image, label[, index]) to a Batch; images of one size stack into one tensor (`join`)."""
    images, labels, *indices = zip(*samples)
    return Batch(join(list(images)), torch.tensor(labels, dtype=torch.int64),
                 torch.tensor(indices[0], dtype=torch.int64) if indices else None)


def sample_rng(seed: int, epoch: int, index: int, copy: int = 0) -> random.Random:
    """One training sample's random stream in one epoch (string seeds hash with SHA-512); each repeated copy its own."""
    return random.Random(f"{seed}:{epoch}:{index}" + (f":{copy}" if copy else ""))


class TrainDataset(Dataset):
    """Indexed by SampleKey (epoch, index): the crop, flip and augmentation derived from that key, at the epoch's
    size. `load`: `pixels.decode_bytes`, or `gpu_decode.encode_bytes` (the device decodes and augments)."""

    def __init__(self, source: Source, size: Union[int, TrainSizes], seed: int, load: Load = pixels.decode_bytes,
                 augment: Augment = INCEPTION_CROP) -> None:
        self.source, self.seed, self.load, self.augment = source, seed, load, augment
        self.sizes = size if isinstance(size, TrainSizes) else TrainSizes(size)  # the epoch's, under a ramp

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: SampleKey) -> tuple[Any, int, int]:
        """Pixels, class, and the sample's index (carried along so that a step knows what it trained on)."""
        epoch, i, *copy = key
        rng, augment = sample_rng(self.seed, epoch, i, *copy), self.augment

        def choose_crop(width: int, height: int) -> tuple[pixels.Box, bool]:
            box = pixels.random_resized_crop_box(width, height, rng, augment.scale, augment.ratio)
            return box, rng.random() < augment.hflip

        image = self.load(self.source.read(i), self.source.name(i), choose_crop, self.sizes(epoch))
        seed = augment.draw_seed(rng)
        # pixels take the policy and erasing here; an EncodedImage (--decode gpu) carries their draws to the device
        image = augment.apply(image, seed) if isinstance(image, torch.Tensor) else image.augmented(augment, seed)
        return image, self.source.label(i), i


class EvalDataset(Dataset):
    """Each image as the reference's evaluation sees it (pixels.CentreCrop), decoded here or on the device (`load`)."""

    def __init__(self, source: Source, size: int, resize: int, load: EvalLoad = pixels.decode_centre_crop,
                 interpolation: str = "bilinear") -> None:
        self.source, self.load, self.view = source, load, pixels.CentreCrop(size, resize, interpolation)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        """Pixels, class, and the sample's index (per-image scores: ReaL's labels, tools/eval_labels.py)."""
        return self.load(self.source.read(i), self.source.name(i), self.view), self.source.label(i), i


def default_workers(cores: int, local_world_size: int) -> int:
    """The cores left to each local process after its own main thread, at most 8."""
    return min(8, max(1, cores // max(1, local_world_size) - 1))


def _worker_init(ignored_signals: tuple[int, ...], _: int) -> None:
    """One torch thread a worker; preemption signals ignored: Slurm and torchrun signal every process of a task, and
    a worker killed by SIGTERM would take the run down before its checkpoint."""
    torch.set_num_threads(1)
    for signum in ignored_signals:
        signal.signal(signum, signal.SIG_IGN)


def share_heap_with_workers() -> None:
    """Call once the process holds what it will hold when its loader workers fork: a garbage collection writes to
    every object it examines, so a forked worker would copy its parent's pages; frozen objects are left out of
    collections and their pages stay shared. torchvision is imported here: it takes seconds, which a run that stops
    on bad input should not pay, while forked workers should inherit it rather than each import it again."""
    import torchvision.io  # noqa: F401
    import torchvision.transforms.v2  # noqa: F401  (augment.Augment's policies)
    gc.collect()  # what is garbage now would never be collected once frozen
    gc.freeze()


thaw_heap = gc.unfreeze  # undoes `share_heap_with_workers` as the rank ends: what it froze is collectable again


def stop_loader_workers() -> None:
    """SIGKILL loader workers still alive as the rank ends (they ignore SIGTERM: multiprocessing's exit handler would
    wait forever), with SIGCHLD's default handler: torch's would raise "DataLoader worker is killed" mid clean-up."""
    children = multiprocessing.active_children()
    if children and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
        child.join()


# Workers fork where the platform allows: a rank started by `--dist-init-method spawn` (or Slurm) inherits "spawn",
# whose workers would each re-import torch (seconds) and get a pickled copy of the file index, not shared pages.
_WORKER_START = "fork" if "fork" in multiprocessing.get_all_start_methods() else None


PREFETCH = 4  # batches each loader worker prepares ahead, at most
MIN_PREFETCH = 2  # fewer, and a worker would wait idle while its one batch is taken
PINNED_BUDGET = 2**30  # page-locked bytes a rank's batches in flight may take on CUDA (see prefetch_factor)
ENCODED_IMAGE_BYTES = 110_000  # ImageNet's mean JPEG: an image's bytes in a --decode gpu batch, estimated


def batch_bytes(batch_size: int, size: int, encoded: bool) -> int:
    """One loader batch's bytes at most: size x size x 3 an image, or ImageNet's mean JPEG under --decode gpu."""
    return batch_size * (ENCODED_IMAGE_BYTES if encoded else size * size * 3)


def prefetch_factor(workers: int, batch_bytes: int, pinned: bool, budget: int = PINNED_BUDGET) -> int:
    """Batches each worker prepares ahead: PREFETCH, lowered (not below MIN_PREFETCH) until workers x factor x
    batch_bytes fit `budget` where pinned (CUDA): pinned RAM is lost to the page cache and other processes. Train and
    val loaders are not read at once and torch's pinned allocator reuses the blocks, so one budget covers both."""
    if not pinned or workers == 0:
        return PREFETCH
    return max(MIN_PREFETCH, min(PREFETCH, budget // max(1, workers * batch_bytes)))


class Gate:
    """A sampler that hands out nothing while it is closed (see `start_workers`)."""

    def __init__(self, sampler: Iterable) -> None:
        self.sampler, self.open = sampler, True

    def __iter__(self) -> Iterator:
        return iter(self.sampler) if self.open else iter(())

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


def start_workers(loader: DataLoader) -> None:
    """Fork the loader's persistent workers now, handing them no work, while the process has no other thread: gloo's
    threads take the interpreter's thread-list lock without the GIL, a fork copies it held, and a CPython without the
    fix for gh-112275 deadlocks the new worker in PyOS_AfterFork_Child (docs/DESIGN.md)."""
    if loader.num_workers == 0:
        return
    gate = loader.batch_sampler if isinstance(loader.batch_sampler, Gate) else loader.sampler
    assert isinstance(gate, Gate), "start_workers needs a loader made by this module"
    gate.open = False
    try:
        for _ in loader:  # starts the workers; the closed gate gives them nothing to do
            pass
    finally:
        gate.open = True


def make_loader(dataset: Dataset, workers: int, pin_memory: bool, ignored_signals: tuple[int, ...],
                collate_fn: Callable[[list], Batch], prefetch: int, **sampling: Any) -> DataLoader:
    """A DataLoader of `dataset` in the order `sampling` gives (a Gate in it: see `start_workers`)."""
    options = {"num_workers": workers, "pin_memory": pin_memory, "collate_fn": collate_fn,
               "worker_init_fn": functools.partial(_worker_init, ignored_signals)}
    if workers > 0:
        options.update(persistent_workers=True, prefetch_factor=prefetch, multiprocessing_context=_WORKER_START)
    return DataLoader(dataset, generator=torch.Generator().manual_seed(0), **sampling, **options)


def train_loader(dataset: TrainDataset, sampler: TrainBatchSampler, workers: int, pin_memory: bool,
                 ignored_signals: tuple[int, ...] = (), collate_fn: Callable[[list], Batch] = collate,
                 prefetch: int = PREFETCH) -> DataLoader:
    return make_loader(dataset, workers, pin_memory, ignored_signals, collate_fn, prefetch,
                       batch_sampler=Gate(sampler))


def eval_loader(dataset: EvalDataset, batch_size: int, rank: int, world_size: int, workers: int,
                pin_memory: bool, ignored_signals: tuple[int, ...] = (),
                collate_fn: Callable[[list], Batch] = collate, prefetch: int = PREFETCH) -> DataLoader:
    return make_loader(dataset, workers, pin_memory, ignored_signals, collate_fn, prefetch, batch_size=batch_size,
                       sampler=Gate(eval_shard(len(dataset), rank, world_size)))
