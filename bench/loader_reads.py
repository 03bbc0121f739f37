"""`python bench/benchmark.py DATA --mode reads`: what our loader's workers do to read a sample of DATA.

The files each sample's read opens in the loader workers (a class folder's image, against a pack's shard once per
worker), and, where DATA's samples have checksums (a pack), our loader against itself without comparing them: what
the check costs, in alternating rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import statistics
import sys
import tempfile
from typing import Any, Optional

import imagenet_elastic
from imagenet_elastic.data import sources
from imagenet_elastic.data.augment import Augment
from imagenet_elastic.tools import throughput

# where a worker's other opens go (late imports, /proc, multiprocessing's temp files): not the data's
NOT_DATA = tuple({sys.prefix, sys.base_prefix, os.path.dirname(imagenet_elastic.__file__), "/proc", "/sys", "/dev",
                  os.path.join(tempfile.gettempdir(), "pymp-")})


class Counted:
    """A source whose reads in the loader workers are counted with the files each opens (audit hook), in counters
    shared with the forked workers (which never pickle it)."""

    def __init__(self, source: sources.Source) -> None:
        context = multiprocessing.get_context("fork")
        self.source, self.opens, self.samples = source, context.Value("q", 0), context.Value("q", 0)
        self.hooked: set[int] = set()  # processes whose hook is installed (a hook stays for the process's life)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def __len__(self) -> int:
        return len(self.source)

    def read(self, i: int) -> bytes:
        if os.getpid() not in self.hooked:
            self.hooked.add(os.getpid())
            opens = self.opens

            def hook(event: str, args: tuple) -> None:
                if event == "open" and isinstance(args[0], str) and not args[0].startswith(NOT_DATA):
                    with opens.get_lock():
                        opens.value += 1
            sys.addaudithook(hook)
        with self.samples.get_lock():
            self.samples.value += 1
        return self.source.read(i)

    def opens_per_sample(self) -> Optional[float]:
        return round(self.opens.value / self.samples.value, 3) if self.samples.value else None


def run_reads(args: argparse.Namespace, train: sources.Source, workers: int) -> dict[str, Any]:
    """Our loader on DATA, counted; with DATA's checksums dropped too where it has them."""
    augment = Augment(policy=args.auto_augment, erase=args.random_erase)
    feed = throughput.make_feed(args, throughput.run_device(args), workers, augment)
    counted = Counted(train)
    contenders = {"ours": throughput.ours_loader(counted, feed, args, augment)}
    if getattr(train, "checksums", None) is not None:
        unchecked = dataclasses.replace(train, checksums=None)
        contenders["unverified"] = throughput.ours_loader(unchecked, feed, args, augment)
    rates = throughput.alternating_rounds(contenders, args, warmup=max(2, 2 * workers))
    rate = {name: statistics.median(values) for name, values in rates.items()}
    figures: dict[str, Any] = {"data": train.where(), "files_opened_per_sample": counted.opens_per_sample(),
                               "images_per_sec": round(rate["ours"], 1)}
    if "unverified" in rate:
        figures.update(unverified_images_per_sec=round(rate["unverified"], 1),
                       verified_vs_unverified=round(rate["ours"] / rate["unverified"], 3))
    return {**figures, "rounds": {k: [round(r, 1) for r in v] for k, v in rates.items()},
            "batch_size": args.batch_size, "workers": workers, "decode": feed.decoding.mode}
