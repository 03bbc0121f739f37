"""`imagenet-elastic evaluate MODEL VAL [VAL ...]`: a model's scores on validation sets, with no training folder.

Each VAL is scored by our exact validation (train/step.py evaluate: every image once over all ranks), with the model's
own preprocessing (timm's `resolve_data_config`) or ours (data/pixels.py CentreCrop); what it takes and prints:
docs/OUTPUTS.md. `val_as_trained` is said, not warned: scoring other sets is this tool's purpose. ReaL (Beyer et al.
2020, as timm's RealLabelsImagenet counts it) and --class-subset (the other classes' logits are left out before the
top-k and the loss): eval_labels.py. The trainer's `--evaluate` is a front of the same code path: `evaluate_checkpoint`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from imagenet_elastic.config import (
    LAST_FILE,
    VALIDATION_SENSITIVE,
    Config,
    add_setting,
    eval_sizes,
    saved_eval_sizes,
    saved_setting,
)
from imagenet_elastic.data import sources
from imagenet_elastic.data.pixels import INTERPOLATIONS
from imagenet_elastic.data.sources import fingerprints
from imagenet_elastic.data.sources.base import Classes
from imagenet_elastic.errors import UserError, report
from imagenet_elastic.launch import distributed
from imagenet_elastic.options import HelpFormatter, Parser, positive_int
from imagenet_elastic.tools import eval_labels

if TYPE_CHECKING:
    from imagenet_elastic.launch.launchers import DistEnv
    from imagenet_elastic.models.weights import Weights


def build_parser() -> Parser:
    p = Parser(prog="imagenet-elastic evaluate", description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("model", metavar="MODEL", help="our checkpoint (.pt, or a run's checkpoints folder: its "
                   "best.pt), an export folder, or a timm model name with --pretrained")
    p.add_argument("val", metavar="VAL", nargs="+", help=f"validation sets: {FORMS}")
    p.add_argument("--pretrained", action="store_true", help="MODEL is a timm model name: its pretrained weights")
    p.add_argument("--ema", action="store_true", help="our checkpoint's weight average (--model-ema)")
    p.add_argument("--preprocessing", choices=("model", "ours"), default="model",
                   help="model: the model's own (timm's resolve_data_config: input size, crop fraction, "
                   "interpolation, mean and std; for our checkpoint, its run's validation); ours: the trainer's "
                   "validation at the model's input size")
    p.add_argument("--val-labels", metavar="FILE", help="the classes of the flat folders among VAL (images, no "
                   "folders; see the trainer's --val-labels)")
    p.add_argument("--real-labels", metavar="FILE", help="ReaL labels (real.json): also score ReaL top-1")
    p.add_argument("--class-subset", metavar="FILE", help="score only these classes (one name a line)")
    p.add_argument("--flip-average", action="store_true", dest="val_flip_average", help="the mean of the logits of "
                   "each image and of its mirror image (the trainer's --val-flip-average)")
    p.add_argument("--batch-size", type=positive_int, default=64, metavar="N",
                   help="images per forward pass and process")
    for name in ("workers", "amp", "device", "channels_last", "decode", "gpu_decoder", "dist_timeout"):
        add_setting(p, name)
    return p


FORMS = ("class folders, a flat folder of images with --val-labels, tar shards or parquet files (a folder or a "
         "pattern), or a data root (its val split), each with or without its prefix")


def check_val_exists(locations: Sequence[str]) -> None:
    """Said before the model is loaded: the trainer's message for a missing folder would point at its --val-path."""
    for location in locations:
        prefix, path = sources.kind_of(location)  # an unknown prefix or scheme: one line naming the known ones
        if not (os.path.exists(path) or sources.is_pattern(location) or sources.is_url(path)):  # a store's: opened
            known = ", ".join(f"{p}:" for p in sources.prefixes())
            raise UserError(f"VAL {location} does not exist: evaluate takes {FORMS} ({known})")


def labels_file(location: str, val_labels: str | None) -> str | None:
    """--val-labels names the classes of the flat folders among VAL (image files, no folders), not of the others."""
    return val_labels if val_labels is not None and sources.flat_folder(sources.kind_of(location)[1]) else None


@dataclass(frozen=True)
class Preprocessing:
    """How a model's images are made: its own (timm's data config, or its run's validation), or ours."""

    crop: int
    resize: int
    interpolation: str
    mean: tuple[float, ...]  # as timm gives them: on 0-1 values
    std: tuple[float, ...]

    def describe(self) -> dict[str, Any]:
        return {"crop": self.crop, "resize": self.resize, "interpolation": self.interpolation,
                "mean": [round(m, 4) for m in self.mean], "std": [round(s, 4) for s in self.std]}


def ours(crop: int, resize: Optional[int] = None) -> Preprocessing:
    """The trainer's validation at this crop (resize: config.eval_sizes' default), bilinear, ImageNet's statistics."""
    from imagenet_elastic.data.model_input import IMAGENET_MEAN_FRACTIONS, IMAGENET_STD_FRACTIONS
    return Preprocessing(crop, eval_sizes(crop, None, resize)[1], "bilinear", IMAGENET_MEAN_FRACTIONS,
                         IMAGENET_STD_FRACTIONS)


def timm_preprocessing(module: Any, what: str) -> Preprocessing:
    """timm's resolve_data_config for the model, in our terms (resize = floor(crop / crop_pct), as timm computes it)."""
    from timm.data import resolve_data_config

    data = resolve_data_config({}, model=module)
    _, height, width = data["input_size"]
    if height != width:
        raise UserError(f"{what} takes {height}x{width} images: evaluate takes square inputs only")
    if data.get("crop_mode", "center") != "center":
        raise UserError(f"{what} preprocesses with crop_mode {data['crop_mode']!r}: evaluate does the centre crop "
                        "only; pass --preprocessing ours")
    if data["interpolation"] not in INTERPOLATIONS:
        raise UserError(f"{what} resizes with {data['interpolation']!r} interpolation: evaluate offers "
                        f"{', '.join(INTERPOLATIONS)}; pass --preprocessing ours")
    return Preprocessing(height, math.floor(height / data["crop_pct"]), data["interpolation"],
                         tuple(data["mean"]), tuple(data["std"]))


def load_model(name: str, pretrained: bool, ema: bool) -> tuple[Weights, Preprocessing]:
    """The model MODEL names (models/weights.py), its class_names always set, and its own preprocessing."""
    from imagenet_elastic.models import weights

    loaded = weights.load_weights(name, "MODEL", ema, published=pretrained)
    if loaded.kind == weights.CHECKPOINT:
        return loaded, ours(*saved_eval_sizes(loaded.settings))
    module = loaded.model
    classes = ((loaded.class_names or tuple(module.pretrained_cfg.get("label_names") or ())
                or tuple(map(str, range(module.num_classes))))  # unnamed: by number, for folders named 0..N-1
               if loaded.kind == weights.EXPORT else imagenet_classes(module))
    if len(classes) != module.num_classes:
        raise UserError(f"MODEL {name} names {len(classes)} classes for its {module.num_classes} outputs")
    return dataclasses.replace(loaded, class_names=classes), timm_preprocessing(module, f"MODEL {name}")


def imagenet_classes(module: Any) -> tuple[str, ...]:
    """The wnids of a timm ImageNet model's outputs (n01440764, ...), as ImageNet's class folders name them."""
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset(module)
    if subset is None:
        raise UserError(f"timm model {module.default_cfg.get('architecture')} was not trained on an ImageNet "
                        f"subset timm knows: its {module.num_classes} classes have no names to match VAL's")
    return tuple(ImageNetInfo(subset).label_names())


def score(env: DistEnv, device: Any, modules: dict[str, Any], sets: Sequence[tuple[str, Any, Any]], prep: Preprocessing,
          settings: Any, console: Any, on_scored: Callable[[str, Any, dict[str, Any], str], None],
          columns: Any = None, fit: Any = None) -> None:
    """Every set of `sets` ((location, source, ReaL counts or None)) scored by every model of `modules`;
    `on_scored(location, source, results by model key, precision)` is told of each. `settings`: the run's Config or
    the tool's options (add_setting gives them the same names). Workers fork before the process group forms."""
    from imagenet_elastic.data.augment import INCEPTION_CROP
    from imagenet_elastic.data.decoding import Decoding
    from imagenet_elastic.data.device.feed import device_batches
    from imagenet_elastic.data.model_input import ModelInput
    from imagenet_elastic.models.device import place_model, resolve_precision
    from imagenet_elastic.train import build
    from imagenet_elastic.train.step import evaluate

    precision = resolve_precision(settings.amp, device)
    if precision.warning:
        console.warn(precision.warning)
    cores = distributed.available_cores()
    decoding = Decoding.choose(settings.decode, device, cores // max(1, env.local_world_size), INCEPTION_CROP,
                               settings.gpu_decoder)
    if decoding.warning(device):
        console.warn(decoding.warning(device))
    # the sets are read one after another: one prefetch budget
    feed = decoding.feed(device, settings.workers, cores, env.local_world_size, settings.batch_size, prep.crop,
                         functools.partial(console.warn, every_rank=True))
    with contextlib.ExitStack() as stack:
        loaders = [feed.eval_loader(source, prep.crop, prep.resize, settings.batch_size, env.rank, env.world_size,
                                    interpolation=prep.interpolation) for _, source, _ in sets]
        build.start_loader_workers(loaders, stack)  # before the process group's threads, as the trainer does
        build.join_process_group(env, device, settings.dist_timeout, stack)
        if env.world_size > 1:
            check_same_scoring(modules, sets)
        placed = {key: place_model(module, device, settings.channels_last) for key, module in modules.items()}
        to = ModelInput(device, precision.dtype, settings.channels_last,  # mean and std on 0-255 levels
                        normalisation=(tuple(m * 255 for m in prep.mean), tuple(s * 255 for s in prep.std)))
        for (location, source, counts_of), loader in zip(sets, loaders):
            counts = eval_labels.real_counts(counts_of) if counts_of is not None else None
            results = {key: evaluate(to, module, device_batches(loader, device, feed.decoder),
                                     settings.val_flip_average, columns, counts, fit) for key, module in placed.items()}
            on_scored(location, source, results, precision.name)
        del placed, to  # before the process group goes (join_process_group's callbacks)


def scoring_print(modules: dict[str, Any], sets: Sequence[tuple[str, Any, Any]]) -> tuple[Any, ...]:
    """What every rank must share to score one thing: the code, each model's weights (their sum: identical weights,
    identical sums) and each set's file list (with the labels it is scored by)."""
    from imagenet_elastic.train.consistency import code_version

    with torch.no_grad():
        weights = tuple(sum(float(t.double().sum()) for t in module.state_dict().values() if t.is_floating_point())
                        for module in modules.values())
    return code_version(), weights, tuple(source.fingerprint() for _, source, _ in sets)


def check_same_scoring(modules: dict[str, Any], sets: Sequence[tuple[str, Any, Any]]) -> None:
    """One all-gather: node-local copies that differ by a file (or a model, or the code) would each score without
    error, and the summed counts would mean nothing. JobMismatch on every rank names the first difference."""
    from imagenet_elastic.train.consistency import JobMismatch, first_file_difference, listing

    prints = distributed.all_gather_object(scoring_print(modules, sets))
    rank = next((r for r, theirs in enumerate(prints) if theirs != prints[0]), None)
    if rank is None:
        return
    (code, weights, lists), (own_code, own_weights, own_lists) = prints[0], prints[rank]
    if code != own_code:
        raise JobMismatch(f"ranks run different code: rank 0 runs {code}, rank {rank} runs {own_code}; install the "
                          "same version on every node")
    if weights != own_weights:
        raise JobMismatch(f"ranks score different weights: rank {rank}'s copy of the model differs from rank 0's")
    k = next(k for k, (main, own) in enumerate(zip(lists, own_lists)) if main != own)
    source = sets[k][1]
    where, listed = distributed.broadcast_object((source.where(), listing(source)) if distributed.rank() == 0
                                                 else None, src=0)
    detail = distributed.broadcast_object(first_file_difference(source, listed, distributed.rank()), src=rank)
    raise JobMismatch(f"validation set {where} differs between ranks: rank 0 has {lists[k].count} images in "
                      f"{lists[k].classes} classes, rank {rank} {own_lists[k].count} in {own_lists[k].classes}; "
                      f"{detail}. Node-local copies of the data must be identical")


def run(args: Any) -> list[dict[str, Any]]:
    from imagenet_elastic.launch.launchers import resolve_launch
    from imagenet_elastic.report.console import Console

    env = resolve_launch("env", os.environ).env
    console = Console(env.is_main)
    distributed.configure_threads(None, env.local_world_size)
    device = distributed.select_device(args.device, env)
    check_val_exists(args.val)
    real = eval_labels.read_real_labels(args.real_labels) if args.real_labels else None
    model, own = load_model(args.model, args.pretrained, args.ema)
    classes = model.class_names
    if real is not None:
        eval_labels.check_real_classes(real, args.real_labels, len(classes))
    prep = own if args.preprocessing == "model" else ours(own.crop)
    scored = (eval_labels.read_subset(args.class_subset, classes) if args.class_subset
              else np.arange(len(classes), dtype=np.int64))
    position = np.full(len(classes), -1, dtype=np.int64)
    position[scored] = np.arange(len(scored))
    sets = []
    for location in (sources.evaluated_split(v, args.val_labels) for v in args.val):
        source = sources.open_source(location, "val", None, Classes(classes, "the model"),
                                     labels_file(location, args.val_labels))
        labels = position[eval_labels.model_index(source, classes, location)[source.labels]]
        if (labels < 0).any():
            outside = source.name(int(np.flatnonzero(labels < 0)[0]))
            raise UserError(f"VAL {location}: {outside} is of a class outside --class-subset {args.class_subset}")
        real_of = eval_labels.real_sets(source, real, args.real_labels, position) if real else None
        sets.append((location, eval_labels.Relabelled(source, labels, tuple(classes[k] for k in scored)), real_of))
    rows: list[dict[str, Any]] = []

    def told(location: str, source: eval_labels.Relabelled, results: dict[str, Any], precision: str) -> None:
        result = results[""]
        row: dict[str, Any] = {"model": args.model, "val": location, "images": result.samples,
                               "top1": result.top1, "top5": result.top5, "loss": result.loss}
        if real is not None:
            seen = result.counts["real_images"]
            row.update(real_top1=100 * result.counts["real_right"] / max(seen, 1.0), real_images=int(seen))
        if args.class_subset:
            row["classes"] = len(scored)
        if args.val_flip_average:
            row["flip_average"] = True
        if model.val_print is not None:
            row["val_as_trained"] = fingerprints.difference(model.val_print, source.source) is None
        row.update(preprocessing=args.preprocessing, **prep.describe(), precision=precision, world_size=env.world_size)
        console.result(row)
        rows.append(row)

    columns = None if args.class_subset is None else torch.from_numpy(scored).to(device)
    score(env, device, {"": model.model}, sets, prep, args, console, told, columns)
    if len(rows) > 1:
        console.table("scores", [(row["val"], f"top-1 {row['top1']:.2f}%  top-5 {row['top5']:.2f}%"
                                  + (f", ReaL {row['real_top1']:.2f}%" if "real_top1" in row else "")
                                  + f"  ({row['images']} images)") for row in rows])
    return rows


def precision_difference(saved_amp: str, amp: str, device: torch.device) -> Optional[str]:
    """--amp's change from the checkpoint's run, where the two give this device other precisions: `none` and `auto`
    are both fp32 on a CPU without native bf16."""
    from imagenet_elastic.models.device import resolve_precision

    before, now = (resolve_precision(value, device).name for value in (saved_amp, amp))
    return None if before == now else f"amp: checkpoint {saved_amp!r} ({before} here), now {amp!r} ({now})"


def evaluate_checkpoint(config: Config, env: DistEnv, val: Optional[sources.Source] = None) -> dict[str, Any]:
    """The trainer's `DATA --evaluate --resume CHECKPOINT`, a rank's entry point (cli.py): the checkpoint's weights,
    and their average where it keeps one, on the run's validation split (`val`: a source the caller holds), as one
    JSON line in metrics.jsonl's names (docs/OUTPUTS.md); a setting or split unlike the run's: one warning each."""
    from imagenet_elastic.checkpoint import store
    from imagenet_elastic.data.sampler import BatchPlan
    from imagenet_elastic.models.weights import load_fitting, saved_model
    from imagenet_elastic.report.console import Console
    from imagenet_elastic.train.micro_batch import MicroBatches
    from imagenet_elastic.train.state import check_compatible

    console = Console(env.is_main, env.rank)
    try:
        distributed.configure_threads(config.threads, env.local_world_size)
        device = distributed.select_device(config.device, env)
        if config.resume is None:
            raise UserError("--evaluate needs a checkpoint: pass --resume PATH")
        path = store.CheckpointFolder(config.checkpoints_path, 0).resume_path(config.resume, restarted=False)
        if path is None:
            raise UserError(f"--evaluate needs a checkpoint: {config.checkpoints_path} has no {LAST_FILE}; pass "
                            "--resume PATH")
        snapshot = store.load(path, lazy=True)  # mapped: each weight read once, as the models load it
        if val is None:
            location = config.val_path or sources.split_locations(config.data, None)[1]  # DATA's unless given
            val = sources.open_source(location, "val", None, tuple(snapshot.get("classes", ())), config.val_labels)
        check_compatible(snapshot, path, config.model, val.classes, None, config.blurpool)
        modules = {"": saved_model(snapshot, path, ema=False)}
        if snapshot.get("model_ema") is not None:  # the same model: its average into a copy
            modules["_ema"] = copy.deepcopy(modules[""])
            load_fitting(modules["_ema"], snapshot["model_ema"], f"checkpoint {path}: its 'model_ema' weights",
                         snapshot["model_name"])
        saved = snapshot.get("config", {})
        changes = config.differences(saved, tuple(name for name in VALIDATION_SENSITIVE if name != "amp"))
        changes.append(precision_difference(saved_setting(saved, "amp"), config.amp, device))
        changes += [fingerprints.difference((snapshot.get("data") or {}).get("val"), val)] if env.is_main else []
        for change in filter(None, changes):
            console.warn(f"--evaluate differs from its checkpoint's run, results will not match exactly: {change}")
        del snapshot
        prep = ours(config.eval_crop, config.eval_resize)
        fit = None  # --micro-batch auto: a batch out of memory is scored again in halves, once, as in training
        if config.micro_batch == "auto":
            fit = MicroBatches(BatchPlan(config.batch_size, 1, config.batch_size), config.batch_size, 0, auto=True,
                               warn=functools.partial(console.warn, every_rank=True))
        scores: dict[str, Any] = {"checkpoint": path, **({"val_flip_average": True} if config.val_flip_average else {})}

        def told(location: str, source: sources.Source, results: dict[str, Any], precision: str) -> None:
            for key, result in results.items():
                scores.update({f"val_loss{key}": result.loss, f"val_top1{key}": result.top1,
                               f"val_top5{key}": result.top5, "val_samples": result.samples})

        score(env, device, modules, [(path, val, None)], prep, config, console, told, fit=fit)
    except KeyboardInterrupt:
        console.info("Ctrl-C: --evaluate stopped, nothing written")
        raise
    console.result(scores)
    return scores


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except UserError as error:
        report(error, rank=int(os.environ.get("RANK", "0")))
        sys.exit(error.exit_code)

