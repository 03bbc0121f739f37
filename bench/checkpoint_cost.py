"""`python bench/benchmark.py DATA --mode checkpoint`: what saving the model's training state costs the training
loop.

The synchronous save (`--no-async-checkpoint`: one write and two hard links) against the background save (the
training loop's stall, and how long the write then takes), on the file system of --checkpoints-path, in a
temporary folder there.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from imagenet_elastic.checkpoint import store
from imagenet_elastic.checkpoint.saving import CheckpointWriter
from imagenet_elastic.checkpoint.store import CheckpointFolder
from imagenet_elastic.data import pipeline
from imagenet_elastic.tools import throughput
from imagenet_elastic.tools.benchmark import emit
from imagenet_elastic.train.state import TrainState
from imagenet_elastic.train.step import train_step


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
    times: dict[str, list[float]] = {"sync": [], "stall": [], "write": []}
    try:
        # One folder per way of saving: each replaces (and so frees) only its own previous files, as in a run.
        sync, background = (os.path.join(folder, name) for name in ("sync", "background"))
        warn = functools.partial(print, "warning:", file=sys.stderr)
        manager = CheckpointFolder(sync, keep=1, warn=warn)
        writer = CheckpointWriter(CheckpointFolder(background, keep=1, warn=warn), background=True,
                                  device=ctx.input.device)
        for path in (sync, background):
            os.mkdir(path)
        for epoch in range(1, args.rounds + 1):
            start = time.perf_counter()
            manager.save(state, epoch, is_best=True)
            times["sync"].append(time.perf_counter() - start)
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
         sync_save_seconds=round(median["sync"], 3), stall_seconds=round(median["stall"], 4),
         write_seconds=round(median["write"], 3),
         stall_vs_sync=round(median["stall"] / median["sync"], 3),
         rounds={key: [round(v, 4) for v in values] for key, values in times.items()},
         filesystem=filesystem_of(folder), model=settings["model"], device=settings["device"])
