"""`python bench/benchmark.py DATA --mode index`: the memory an index of the training samples costs each forked
DataLoader worker.

A worker reads every entry of a synthetic ImageNet-sized file index, ours (numpy arrays) against a Python list of
(path, class) tuples, whose reference counts make each worker copy the pages it reads; then a pack's index of as
many samples in 1,024 shards: how long it takes to open, what it holds, what the workers copy of it. Each also
says how long the fingerprint a checkpoint keeps of the split takes (sources/fingerprints.py: at every start). Each
measurement runs in a spawned process of its own, so that nothing measured before raises its peaks.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from imagenet_elastic.data import pipeline
from imagenet_elastic.data.sources import Source, fingerprints
from imagenet_elastic.data.sources.image_folder import ImageFolder
from imagenet_elastic.tools.benchmark import emit

IMAGENET_TRAIN_IMAGES = 1_281_167


def synthetic_index(size: int = IMAGENET_TRAIN_IMAGES, classes: int = 1000) -> ImageFolder:
    """ImageNet-shaped relative paths (`n00000123/n00000123_4567.JPEG`), no files behind them."""
    labels = np.arange(size, dtype=np.int64) * classes // size
    paths = np.array([f"n{t:08d}/n{t:08d}_{i}.JPEG".encode() for i, t in enumerate(labels.tolist())])
    empty = np.array([], dtype="S1")
    return ImageFolder("/data/train", "train", tuple(f"n{c:08d}" for c in range(classes)), paths, labels, empty,
                       np.array([], dtype=np.int64))


class PathLengths(Dataset):
    """Reads entry i of an index as a training dataset would; each sample reports the worker's memory."""

    def __init__(self, lookup: Callable[[int], tuple[str, int]], size: int) -> None:
        self.lookup, self.size = lookup, size
        self.calls, self.memory = 0, (0, 0)  # each worker has its own copy

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        path, target = self.lookup(i)
        self.calls += 1
        if self.calls % 2048 == 1:  # reading /proc costs far more than a lookup
            self.memory = worker_memory_mb()
        return len(path) + target, *self.memory


def worker_memory_mb() -> tuple[int, int]:
    """(peak resident memory VmHWM, private dirty memory) of this process, in MiB. The peak counts
    pages shared with the parent (torch's libraries); private dirty ones are what the worker copied."""
    with open("/proc/self/status") as f:
        peak = int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
    with open("/proc/self/smaps_rollup") as f:
        private = sum(int(line.split()[1]) for line in f if line.startswith("Private_Dirty:"))
    return peak // 1024, private // 1024


def worker_memory(lookup: Callable[[int], tuple[str, int]], size: int, workers: int) -> tuple[int, int]:
    """Largest (peak RSS, private dirty) over the workers, after they read every entry once."""
    loader = DataLoader(PathLengths(lookup, size), batch_size=4096, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(0), multiprocessing_context="fork")
    pipeline.share_heap_with_workers()  # as the trainer does
    peak = private = 0
    for _, peaks, privates in loader:
        peak, private = max(peak, int(peaks.max())), max(private, int(privates.max()))
    return peak, private


def fingerprint_seconds(source: Source) -> float:
    """The best of three: what a start pays for the split's fingerprint, its arrays in memory."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fingerprints.fingerprint(source)
        times.append(time.perf_counter() - start)
    return round(min(times), 3)


def run_index(entries: int, workers: int) -> None:
    index = synthetic_index(entries)
    workers = max(1, workers)
    fingerprinted = fingerprint_seconds(index)
    ours = worker_memory(lambda i: (index.path(i), index.label(i)), len(index), workers)
    tuples = [(index.path(i), index.label(i)) for i in range(len(index))]  # the textbook's samples list
    textbook = worker_memory(tuples.__getitem__, len(tuples), workers)
    emit("index", entries=len(index), index_mb=round((index.paths.nbytes + index.labels.nbytes) / 2**20, 1),
         fingerprint_seconds=fingerprinted, workers=workers, ours_worker_peak_rss_mb=ours[0],
         ours_worker_private_mb=ours[1],
         list_of_tuples_worker_peak_rss_mb=textbook[0], list_of_tuples_worker_private_mb=textbook[1])


def synthetic_pack(folder: str, entries: int, shards: int = 1024, classes: int = 1000) -> str:
    """A pack's train split of `entries` samples in `shards` shards, as `pack` indexes it: ImageNet's mean JPEG
    size (110 kB) a sample, the shards sparse files of the right sizes (nothing is read from them here)."""
    from imagenet_elastic.data.sources import tar_shards

    split = os.path.join(folder, "train")
    os.makedirs(split)
    lengths = np.full(entries, 110_000, dtype=np.int64)
    shard = (np.arange(entries) * shards // entries).astype(np.int32)
    first = np.searchsorted(shard, np.arange(shards))  # each shard's first sample
    position = np.arange(entries) - first[shard]  # a sample's place in its shard: header, image, label's two blocks
    step = 512 + -(-110_000 // 512) * 512 + 1024
    offsets = 512 + position * step
    paths, sizes = [], []
    for k in range(int(shard.max()) + 1):
        paths.append(os.path.join(split, f"shard-{k:06d}.tar"))
        sizes.append(int((shard == k).sum()) * step + 1024)
        with open(paths[-1], "wb") as f:
            f.truncate(sizes[-1])
    labels = np.arange(entries, dtype=np.int64) * classes // entries
    mtimes = np.array([os.stat(p).st_mtime_ns for p in paths], dtype=np.int64)
    checksums = np.random.default_rng(0).integers(0, 2**32, entries, dtype=np.uint32)  # not of these bytes
    index = tar_shards.TarShards(split, "train", tuple(paths), np.array(sizes, dtype=np.int64), mtimes,
                                 tuple(f"n{c:08d}" for c in range(classes)),
                                 labels, shard, offsets.astype(np.int64), lengths, checksums=checksums)
    tar_shards.write_index(index, os.path.join(split, tar_shards.INDEX_NAME), relative_to=split)
    return split


def resident_mb() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def run_shard_index(entries: int, workers: int) -> None:
    """A pack's index: how long a start takes to open it (read it, stat every shard), the memory it holds, and
    what forked loader workers that read every entry copy of it."""
    from imagenet_elastic.data.sources import tar_shards

    folder = tempfile.mkdtemp(prefix="shard-index-benchmark-")
    try:
        split = synthetic_pack(folder, entries)
        before = resident_mb()
        start = time.perf_counter()
        source = tar_shards.open_split(split, "train", None)
        seconds = time.perf_counter() - start
        grown = resident_mb() - before
        fingerprinted = fingerprint_seconds(source)
        arrays = sum(a.nbytes for a in (source.labels, source.shard, source.offsets, source.lengths,
                                        source.checksums))
        peak, private = worker_memory(lambda i: ("x" * int(source.offsets[i] % 5 + source.shard[i] % 3
                                                           + source.checksums[i] % 2),
                                                 source.label(i)), len(source), max(1, workers))
        emit("index", kind="tar shards", entries=len(source), shards=len(source.shards),
             index_file_mb=round(os.path.getsize(os.path.join(split, tar_shards.INDEX_NAME)) / 2**20, 1),
             open_seconds=round(seconds, 3), index_mb=round(arrays / 2**20, 1), open_rss_growth_mb=round(grown, 1),
             fingerprint_seconds=fingerprinted,
             workers=max(1, workers), worker_peak_rss_mb=peak, worker_private_mb=private)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_index_apart(entries: int, workers: int) -> None:
    """`run_index` and `run_shard_index`, each in a fresh (spawned) process: a forked worker's memory starts as its
    parent's, so the figures must not depend on the modes that ran before, and the list of tuples built here
    must not raise their peaks either."""
    for target in (run_index, run_shard_index):
        child = multiprocessing.get_context("spawn").Process(target=target, args=(entries, workers))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"the index benchmark's process failed with exit code {child.exitcode}")

