"""`imagenet-elastic benchmark DATA`: what feeds the model, what the model can take, and both together.

Prints one JSON object per line and mode. A tool, not a test: numbers depend on the machine.

- loader: our training input pipeline (under --decode gpu its workers' part: read, parse, draw) and the
  textbook one (ImageFolder + PIL + RandomResizedCrop + flip + ToTensor + Normalize in DataLoader workers, as in
  pytorch/examples), same folder, workers and batch, measured in alternating rounds in one run; DATA may be any
  source (a folder, tar shards), the textbook one runs where it is a folder, and --against adds our loader on
  other sources of the same images (a pack against its folder); each says how many files its workers opened
  per sample; where DATA's samples have checksums (a pack), also ours without comparing them;
- synthetic: training steps on batches already on the device (the model's limit), for DATA's classes;
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

import sys
from collections.abc import Sequence

import torch

from imagenet_elastic.config import add_setting
from imagenet_elastic.config.options import HelpFormatter, Parser, positive_int
from imagenet_elastic.data import pipeline, sources
from imagenet_elastic.errors import UserError, report
from imagenet_elastic.launch import distributed
from imagenet_elastic.tools import checkpoint_cost, device_ops, index_memory, throughput
from imagenet_elastic.tools.benchmark_lines import emit
from imagenet_elastic.tools.index_memory import IMAGENET_TRAIN_IMAGES

MODES = ("loader", "synthetic", "end_to_end", "device_ops", "index", "checkpoint")


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


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    workers = args.workers if args.workers is not None else pipeline.default_workers(distributed.available_cores(), 1)
    try:
        modes = MODES if args.mode == "all" else (args.mode,)
        needs_data = [mode for mode in modes if mode in ("loader", "synthetic", "end_to_end", "device_ops")]
        train = sources.open_source(sources.train_location(args.data), "train", None) if needs_data else None
        against = tuple(sources.open_source(sources.train_location(other), "train", None) for other in args.against)
        for mode in modes:
            if torch.cuda.is_available():  # each mode's line reports its own peak
                torch.cuda.reset_peak_memory_stats()
            if mode == "loader":
                emit(mode, **throughput.run_loader(args, train, workers, against))
            elif mode == "synthetic":
                emit(mode, **throughput.run_synthetic(args, len(train.classes)))
            elif mode == "end_to_end":
                emit(mode, **throughput.run_end_to_end(args, train, workers))
            elif mode == "device_ops":
                for row in device_ops.run_device_ops(args, train, throughput.run_device(args)):
                    emit(mode, **row)
            elif mode == "index":
                index_memory.run_index_apart(args.index_entries, workers)
            else:
                checkpoint_cost.run_checkpoint(args)
    except UserError as error:
        report(error, rank=0)
        sys.exit(error.exit_code)
