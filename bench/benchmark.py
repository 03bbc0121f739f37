#!/usr/bin/env python
"""The project's own measurements, beside `imagenet-elastic benchmark` (loader, synthetic, end_to_end); not installed.

    python bench/benchmark.py DATA --mode {device_ops,index,checkpoint,reads,all} [the benchmark's settings]

Runs from a checkout, installed or not: the package it measures is the checkout's. Prints one JSON object per line
(and per batch size for device_ops), with the peak memory as `imagenet-elastic benchmark`'s lines have it.

- device_ops: the operators --decode gpu's device path dispatches per batch of 64, 128 and 256 images from DATA
  (on the CPU's tensors where there is no GPU): the same count at every batch size (device_ops.py);
- index: peak RSS of DataLoader workers that read every entry of a synthetic 1.28 M-image file index,
  ours (numpy arrays) against a Python list of (path, class) tuples; then a pack's index of as many samples
  in 1,024 shards: how long it takes to open, what it holds, what forked workers copy of it (index_memory.py);
- checkpoint: what a save of the model's training state costs in a temporary folder under --checkpoints-path:
  the synchronous save (one write and two hard links) against a background save (what the training loop waits
  for, and how long the write takes) (checkpoint_cost.py);
- reads: the files our loader's workers open per sample of DATA and, where its samples have checksums (a pack),
  our loader against itself without comparing them, in alternating rounds (loader_reads.py).
Only device_ops and reads read DATA.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import checkpoint_cost  # noqa: E402
import device_ops  # noqa: E402
import index_memory  # noqa: E402
import loader_reads  # noqa: E402

from imagenet_elastic.config import add_setting  # noqa: E402
from imagenet_elastic.data import sources  # noqa: E402
from imagenet_elastic.errors import UserError, report  # noqa: E402
from imagenet_elastic.options import Parser, positive_int  # noqa: E402
from imagenet_elastic.tools import benchmark, throughput  # noqa: E402

MODES = ("device_ops", "index", "checkpoint", "reads")


def build_parser() -> Parser:
    p = benchmark.parser("python bench/benchmark.py", __doc__, MODES)
    add_setting(p, "checkpoints_path", default=".",
                help="checkpoint mode writes in a temporary folder here: the disk your checkpoints use")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="checkpoint mode: saves each way; reads mode: alternating rounds (medians)")
    p.add_argument("--batches", type=positive_int, default=30, help="reads mode: measured batches per round")
    p.add_argument("--index-entries", type=positive_int, default=index_memory.IMAGENET_TRAIN_IMAGES,
                   help="size of the synthetic file index (index mode)")
    return p


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    try:
        modes = MODES if args.mode == "all" else (args.mode,)
        for mode in modes:
            benchmark.reset_gpu_peak()
            if mode == "device_ops":
                train = sources.open_source(sources.train_location(args.data), "train", None)
                for row in device_ops.run_device_ops(args, train, throughput.run_device(args)):
                    benchmark.emit(mode, **row)
            elif mode == "index":
                index_memory.run_index_apart(args.index_entries, benchmark.loader_workers(args))
            elif mode == "reads":
                train = sources.open_source(sources.train_location(args.data), "train", None)
                benchmark.emit(mode, **loader_reads.run_reads(args, train, benchmark.loader_workers(args)))
            else:
                checkpoint_cost.run_checkpoint(args)
    except UserError as error:
        report(error, rank=0)
        sys.exit(error.exit_code)


if __name__ == "__main__":
    main(sys.argv[1:])
