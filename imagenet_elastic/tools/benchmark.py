"""`imagenet-elastic benchmark DATA`: what feeds the model, what the model can take, and both together.

Prints one JSON object per line and mode. A tool, not a test: numbers depend on the machine.

- loader: our training input pipeline (under --decode gpu its workers' part: read, parse, draw) and the
  textbook one (ImageFolder + PIL + RandomResizedCrop + flip + ToTensor + Normalize in DataLoader workers, as in
  pytorch/examples), same folder, workers and batch, measured in alternating rounds in one run; DATA may be any
  source (a folder, tar shards), the textbook one runs where it is a folder, and --against adds our loader on
  other sources of the same images (a pack against its folder); each says how many files its workers opened
  per sample;
- synthetic: training steps on batches already on the device (the model's limit);
- end_to_end: training steps fed by our loader from the folder;
- device_ops: the operators --decode gpu's device path dispatches per batch of 64, 128 and 256 images from DATA
  (on the CPU's tensors where there is no GPU): the same count at every batch size (tools/device_ops.py);
- index: peak RSS of DataLoader workers that read every entry of a synthetic 1.28 M-image file index,
  ours (numpy arrays) against a Python list of (path, class) tuples; then a pack's index of as many samples
  in 1,024 shards: how long it takes to open, what it holds, what forked workers copy of it;
- checkpoint: what a save of the model's training state costs in a temporary folder under
  --checkpoints-path: the old synchronous save (serialize, then three atomic writes), one write with
  hard links, and a background save (what the training loop waits for, and how long the write takes).
Every line also says the peak host RSS (this process and, separately, its largest child) and the
peak GPU memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from imagenet_elastic.checkpoint import store
from imagenet_elastic.checkpoint.atomic import atomic_write_bytes
from imagenet_elastic.checkpoint.saving import CheckpointWriter
from imagenet_elastic.checkpoint.store import CheckpointManager
from imagenet_elastic.config import add_setting
from imagenet_elastic.config.options import HelpFormatter, Parser, positive_int
from imagenet_elastic.data import pipeline, sources
from imagenet_elastic.data.sources.image_folder import ImageFolder
from imagenet_elastic.errors import UserError, report
from imagenet_elastic.launch import distributed
from imagenet_elastic.tools import device_ops, throughput
from imagenet_elastic.train.state import TrainState
from imagenet_elastic.train.step import train_step

MODES = ("loader", "synthetic", "end_to_end", "device_ops", "index", "checkpoint")
IMAGENET_TRAIN_IMAGES = 1_281_167


# The training settings the benchmark takes, declared by the trainer's own fields (config.add_setting)
TRAINING_SETTINGS = ("model", "batch_size", "workers", "image_size", "auto_augment", "random_erase", "amp",
                     "channels_last", "compile", "blurpool", "decode", "gpu_decoder", "device")
# Where the benchmark's default differs from the trainer's: it measures what it is told, so compiling (the trainer's
# default on CUDA) is a mode of its own (scripts/gpu_checks.sh's compile parts)
BENCHMARK_DEFAULTS = {"compile": {"default": False, "help": "`torch.compile` the model (default: off)"}}


def build_parser() -> Parser:
    p = Parser(prog="imagenet-elastic benchmark", description=__doc__,
               formatter_class=HelpFormatter)
    p.add_argument("data", metavar="DATA", help="a data root with train/, or the train split itself (class folders, "
                   "tar shards or a shard pattern)")
    p.add_argument("--against", metavar="DATA", nargs="+", default=[], help="loader mode: also our loader on these "
                   "(another form of the same images, e.g. the folder a pack was made from)")
    p.add_argument("--mode", choices=[*MODES, "all"], default="all")
    for name in TRAINING_SETTINGS:
        add_setting(p, name, **BENCHMARK_DEFAULTS.get(name, {}))
    add_setting(p, "checkpoints_path", default=".",
                help="checkpoint mode writes in a temporary folder here: the disk your checkpoints use")
    p.add_argument("--batches", type=positive_int, default=30, help="measured batches per round or mode")
    p.add_argument("--rounds", type=positive_int, default=3, help="alternating rounds of the loader comparison")
    p.add_argument("--index-entries", type=positive_int, default=IMAGENET_TRAIN_IMAGES,
                   help="size of the synthetic file index (index mode)")
    return p


def emit(mode: str, **fields: Any) -> None:
    print(json.dumps({"mode": mode, **fields, **memory_peaks()}), flush=True)


def memory_peaks() -> dict[str, Optional[float]]:
    """ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN is the largest child that has been waited for."""
    return {
        "peak_host_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_child_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None,
    }


# ----------------------------------------------------------------------------- index memory

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


def run_index(entries: int, workers: int) -> None:
    index = synthetic_index(entries)
    workers = max(1, workers)
    ours = worker_memory(lambda i: (index.path(i), index.label(i)), len(index), workers)
    tuples = [(index.path(i), index.label(i)) for i in range(len(index))]  # the textbook's samples list
    textbook = worker_memory(tuples.__getitem__, len(tuples), workers)
    emit("index", entries=len(index), index_mb=round((index.paths.nbytes + index.labels.nbytes) / 2**20, 1),
         workers=workers, ours_worker_peak_rss_mb=ours[0], ours_worker_private_mb=ours[1],
         list_of_tuples_worker_peak_rss_mb=textbook[0], list_of_tuples_worker_private_mb=textbook[1])


def synthetic_pack(folder: str, entries: int, shards: int = 1024, classes: int = 1000) -> str:
    """A pack's train split of `entries` samples in `shards` shards, as `pack` indexes it: ImageNet's mean JPEG
    size (110 kB) a sample, the shards sparse files of the right sizes (nothing is read from them here)."""
    from imagenet_elastic.data.sources import tar_index

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
    index = tar_index.TarShards(split, "train", tuple(paths), np.array(sizes, dtype=np.int64), mtimes,
                                tuple(f"n{c:08d}" for c in range(classes)),
                                labels, shard, offsets.astype(np.int64), lengths)
    tar_index.write_index(index, os.path.join(split, tar_index.INDEX_NAME), relative_to=split)
    return split


def resident_mb() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def run_shard_index(entries: int, workers: int) -> None:
    """A pack's index: how long a start takes to open it (read it, stat every shard), the memory it holds, and
    what forked loader workers that read every entry copy of it."""
    from imagenet_elastic.data.sources import tar_index, tar_shards

    folder = tempfile.mkdtemp(prefix="shard-index-benchmark-")
    try:
        split = synthetic_pack(folder, entries)
        before = resident_mb()
        start = time.perf_counter()
        source = tar_shards.open_split(split, "train", None)
        seconds = time.perf_counter() - start
        grown = resident_mb() - before
        arrays = sum(a.nbytes for a in (source.labels, source.shard, source.offsets, source.lengths))
        peak, private = worker_memory(lambda i: ("x" * int(source.offsets[i] % 5 + source.shard[i] % 3),
                                                 source.label(i)), len(source), max(1, workers))
        emit("index", kind="tar shards", entries=len(source), shards=len(source.shards),
             index_file_mb=round(os.path.getsize(os.path.join(split, tar_index.INDEX_NAME)) / 2**20, 1),
             open_seconds=round(seconds, 3), index_mb=round(arrays / 2**20, 1), open_rss_growth_mb=round(grown, 1),
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


# ----------------------------------------------------------------------------- checkpoint cost

def three_write_save(state: dict[str, Any], folder: str, epoch: int) -> None:
    """The save this project made before hard links: serialize to bytes, then write them three times."""
    data = store.serialize(state)
    for name in (f"epoch_{epoch:04d}.pt", store.LAST, store.BEST):
        atomic_write_bytes(data, os.path.join(folder, name))


def filesystem_of(path: str) -> str:
    """The type of the mount that holds `path` (ext4, xfs, nfs, tmpfs...), from /proc/mounts."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                _, point, fs_type, *_ = line.split()
                if os.path.abspath(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                    best, kind = point, fs_type
    except OSError:
        pass
    return kind


def run_checkpoint(args: argparse.Namespace) -> None:
    ctx, settings = throughput.step_context(args, 1000)
    size = min(args.image_size, 64)  # one small step, so that the optimizer's momentum exists as in training
    images = torch.randint(0, 256, (2, size, size, 3), dtype=torch.uint8, device=ctx.input.device)
    labels = torch.randint(0, 1000, (2,), device=ctx.input.device)
    train_step(ctx, [pipeline.Batch(images, labels)], [slice(0, 2)], 2, 0.1, seed=0, step=0)
    model = getattr(ctx.model, "_orig_mod", ctx.model)
    state = TrainState(model, ctx.optimizer, ctx.scaler).capture({}, {})
    folder = tempfile.mkdtemp(prefix="checkpoint-benchmark-", dir=args.checkpoints_path)
    times: dict[str, list[float]] = {"sync": [], "one_write": [], "stall": [], "write": []}
    try:
        # One folder per way of saving: each replaces (and so frees) only its own previous files, as in a run.
        old, new, background = (os.path.join(folder, name) for name in ("old", "new", "background"))
        warn = functools.partial(print, "warning:", file=sys.stderr)
        manager = CheckpointManager(new, keep=1, warn=warn)
        writer = CheckpointWriter(CheckpointManager(background, keep=1, warn=warn), background=True,
                                  device=ctx.input.device)
        for path in (old, new, background):
            os.mkdir(path)
        for epoch in range(1, args.rounds + 1):
            start = time.perf_counter()
            three_write_save(state, old, epoch)
            times["sync"].append(time.perf_counter() - start)
            start = time.perf_counter()
            manager.save(state, epoch, is_best=True)
            times["one_write"].append(time.perf_counter() - start)
            writer.submit(state, epoch, is_best=True)
            times["stall"].append(writer.stall_seconds)
            if writer.wait() is not None:
                raise writer.take_error()
            times["write"].append(writer.write_seconds)
        writer.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    median = {key: statistics.median(values) for key, values in times.items()}
    emit("checkpoint", state_mb=round(store.state_bytes(state) / 1e6, 1),
         sync_save_seconds=round(median["sync"], 3), one_write_save_seconds=round(median["one_write"], 3),
         stall_seconds=round(median["stall"], 4), write_seconds=round(median["write"], 3),
         stall_vs_sync=round(median["stall"] / median["sync"], 3),
         rounds={key: [round(v, 4) for v in values] for key, values in times.items()},
         filesystem=filesystem_of(folder), model=settings["model"], device=settings["device"])


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    workers = args.workers if args.workers is not None else pipeline.default_workers(distributed.available_cores(), 1)
    try:
        modes = MODES if args.mode == "all" else (args.mode,)
        needs_data = [mode for mode in modes if mode in ("loader", "end_to_end", "device_ops")]
        train = sources.open_source(sources.train_location(args.data), "train", None) if needs_data else None
        against = tuple(sources.open_source(sources.train_location(other), "train", None) for other in args.against)
        for mode in modes:
            if torch.cuda.is_available():  # each mode's line reports its own peak
                torch.cuda.reset_peak_memory_stats()
            if mode == "loader":
                emit(mode, **throughput.run_loader(args, train, workers, against))
            elif mode == "synthetic":
                emit(mode, **throughput.run_synthetic(args))
            elif mode == "end_to_end":
                emit(mode, **throughput.run_end_to_end(args, train, workers))
            elif mode == "device_ops":
                for row in device_ops.run_device_ops(args, train, throughput.run_device(args)):
                    emit(mode, **row)
            elif mode == "index":
                run_index_apart(args.index_entries, workers)
            else:
                run_checkpoint(args)
    except UserError as error:
        report(error, rank=0)
        sys.exit(error.exit_code)
