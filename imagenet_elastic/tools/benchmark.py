"""`imagenet-elastic benchmark DATA`: what feeds the model, what the model can take, and both together.

Prints one JSON object per line and mode. A tool, not a test: numbers depend on the machine. What the project's
own changes are measured by (the device path's operators, an index's memory, a checkpoint's cost, the files a
sample's read opens and what a pack's checksums cost) is the repository's bench/benchmark.py, with the same
settings; it is not installed.

- loader: our training input pipeline (under --decode gpu its workers' part: read, parse, draw) and the
  textbook one (ImageFolder + PIL + RandomResizedCrop + flip + ToTensor + Normalize in DataLoader workers, as in
  pytorch/examples), same folder, workers and batch, measured in alternating rounds in one run; DATA may be any
  source (a folder, tar shards), the textbook one runs where it is a folder, and --against adds our loader on
  other sources of the same images (a pack against its folder);
- synthetic: training steps on batches already on the device (the model's limit), for DATA's classes;
- end_to_end: training steps fed by our loader from the folder.

Every line also says the peak host RSS (this process and, separately, its largest child) and the
peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from collections.abc import Sequence
from typing import Any

import torch

from imagenet_elastic.config import add_setting
from imagenet_elastic.data import pipeline, sources
from imagenet_elastic.errors import UserError, report
from imagenet_elastic.launch import distributed
from imagenet_elastic.options import HelpFormatter, Parser, positive_int
from imagenet_elastic.tools import throughput

MODES = ("loader", "synthetic", "end_to_end")

TRAINING_SETTINGS = ("model", "batch_size", "workers", "image_size", "auto_augment", "random_erase", "amp",
                     "channels_last", "compile", "blurpool", "decode", "gpu_decoder", "device")
# it measures what it is told: compiling (the trainer's default on CUDA) is a mode of its own
BENCHMARK_DEFAULTS = {"compile": {"default": False, "help": "`torch.compile` the model (default: off)"}}


def parser(prog: str, description: str, modes: Sequence[str]) -> Parser:
    """DATA, --mode and the training settings: what this benchmark and bench/benchmark.py both take."""
    p = Parser(prog=prog, description=description, formatter_class=HelpFormatter)
    p.add_argument("data", metavar="DATA", help="a data root with train/, or the train split itself (class folders, "
                   "tar shards or a shard pattern)")
    p.add_argument("--mode", choices=[*modes, "all"], default="all")
    for name in TRAINING_SETTINGS:
        add_setting(p, name, **BENCHMARK_DEFAULTS.get(name, {}))
    return p


def build_parser() -> Parser:
    p = parser("imagenet-elastic benchmark", __doc__, MODES)
    p.add_argument("--against", metavar="DATA", nargs="+", default=[], help="loader mode: also our loader on these "
                   "(another form of the same images, e.g. the folder a pack was made from)")
    p.add_argument("--batches", type=positive_int, default=30, help="measured batches per round or mode")
    p.add_argument("--rounds", type=positive_int, default=3, help="alternating rounds of the loader comparison")
    return p


def loader_workers(args: argparse.Namespace) -> int:
    """--workers, else as many as the trainer would start on this machine as one rank."""
    return args.workers if args.workers is not None else pipeline.default_workers(distributed.available_cores(), 1)


def emit(mode: str, **fields: Any) -> None:
    """A mode's line: one JSON object with the peak memory of the process that measured it (ru_maxrss is in KiB on
    Linux; RUSAGE_CHILDREN is the largest child that has been waited for)."""
    peaks = {"peak_host_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
             "peak_child_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
             "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None}
    print(json.dumps({"mode": mode, **fields, **peaks}), flush=True)


def reset_gpu_peak() -> None:
    """Each mode's line reports its own peak."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    workers = loader_workers(args)
    try:
        train = sources.open_source(sources.train_location(args.data), "train", None)
        against = tuple(sources.open_source(sources.train_location(other), "train", None) for other in args.against)
        runs = {"loader": lambda: throughput.run_loader(args, train, workers, against),
                "synthetic": lambda: throughput.run_synthetic(args, len(train.classes)),
                "end_to_end": lambda: throughput.run_end_to_end(args, train, workers)}
        for mode in MODES if args.mode == "all" else (args.mode,):
            reset_gpu_peak()
            emit(mode, **runs[mode]())
    except UserError as error:
        report(error, rank=0)
        sys.exit(error.exit_code)
