"""`imagenet-elastic evaluate MODEL VAL [VAL ...]`: a model's scores on validation sets, with no training folder.

MODEL is a checkpoint of ours (best.pt, last.pt; --ema for its weight average), a folder `imagenet-elastic export`
wrote, or a timm model name with --pretrained (its weights as timm fetches them). VAL is any validation split the
trainer reads: class folders (named by the model's classes, or numbered 0..N-1 as ImageNet-V2's), a flat folder with
--val-labels, tar shards. Each VAL is scored by our exact validation (train/step.py evaluate: every image once over
all ranks, whatever the world size; `torchrun ... -m imagenet_elastic evaluate ...`), with the model's own
preprocessing (what timm's `resolve_data_config` gives it, as timm's validate.py) or ours (--preprocessing ours: the
trainer's validation, bilinear, crop / 0.875, ImageNet's mean and std), computed as the reference computes it
(data/pixels.py CentreCrop). Rank 0 prints one JSON line per VAL, and a table when there are several.

--real-labels real.json: ReaL top-1 (Beyer et al. 2020) as timm's RealLabelsImagenet counts it: an image counts when
its list of real labels is not empty, and is right when its top-1 class is in it. real.json lists the 50,000 images
of ImageNet's validation set in the order of their file names; an image of VAL is looked up by the number in its
name (ILSVRC2012_val_00000001 is the first entry), whatever the folder or shard holds it.
--class-subset FILE: the class names (one a line; wnids for ImageNet-A and -R's 200) whose logits are scored: the
others are left out before the top-k and the loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from imagenet_elastic.config import add_setting, eval_sizes, saved_setting
from imagenet_elastic.config.options import HelpFormatter, Parser, positive_int
from imagenet_elastic.data.pixels import INTERPOLATIONS
from imagenet_elastic.data.sources.base import Source
from imagenet_elastic.errors import UserError, report

PREPROCESSING = ("model", "ours")
REAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})")
REAL_ENTRIES = 50_000  # real.json's: one per image of ImageNet's validation set, in the order of their names


def build_parser() -> Parser:
    p = Parser(prog="imagenet-elastic evaluate", description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("model", metavar="MODEL", help="our checkpoint (.pt), an export folder, or a timm model name "
                   "with --pretrained")
    p.add_argument("val", metavar="VAL", nargs="+", help="validation sets: class folders, a flat folder with "
                   "--val-labels, tar shards (a folder or a pattern)")
    p.add_argument("--pretrained", action="store_true", help="MODEL is a timm model name: its pretrained weights")
    p.add_argument("--ema", action="store_true", help="our checkpoint's weight average (--model-ema)")
    p.add_argument("--preprocessing", choices=PREPROCESSING, default="model",
                   help="model: the model's own (timm's resolve_data_config: input size, crop fraction, "
                   "interpolation, mean and std; for our checkpoint, its run's validation); ours: the trainer's "
                   "validation at the model's input size")
    p.add_argument("--val-labels", metavar="FILE", help="the classes of the flat folders among VAL (images, no "
                   "folders; see the trainer's --val-labels)")
    p.add_argument("--real-labels", metavar="FILE", help="ReaL labels (real.json): also score ReaL top-1")
    p.add_argument("--class-subset", metavar="FILE", help="score only these classes (one name a line)")
    p.add_argument("--flip-average", action="store_true", help="the mean of the logits of each image and of its "
                   "mirror image (the trainer's --val-flip-average)")
    p.add_argument("--batch-size", type=positive_int, default=64, metavar="N",
                   help="images per forward pass and process")
    add_setting(p, "workers")
    add_setting(p, "amp")
    add_setting(p, "device")
    add_setting(p, "channels_last")
    add_setting(p, "decode")
    add_setting(p, "gpu_decoder")
    add_setting(p, "dist_timeout")
    return p


@dataclass(frozen=True)
class Preprocessing:
    crop: int
    resize: int
    interpolation: str
    mean: tuple[float, ...]  # as timm gives them: on 0-1 values
    std: tuple[float, ...]

    def describe(self) -> dict[str, Any]:
        return {"crop": self.crop, "resize": self.resize, "interpolation": self.interpolation,
                "mean": [round(m, 4) for m in self.mean], "std": [round(s, 4) for s in self.std]}


@dataclass
class Model:
    module: Any  # nn.Module
    classes: tuple[str, ...]
    own: Preprocessing  # the model's own
    input_size: int


def ours(crop: int) -> Preprocessing:
    """The trainer's validation at this crop (config.eval_sizes' resize, bilinear, ImageNet's statistics)."""
    from imagenet_elastic.data.model_input import IMAGENET_MEAN, IMAGENET_STD
    return Preprocessing(crop, eval_sizes(crop, None, None)[1], "bilinear", tuple(m / 255 for m in IMAGENET_MEAN),
                         tuple(s / 255 for s in IMAGENET_STD))


def timm_preprocessing(module: Any, what: str) -> Preprocessing:
    """What timm's resolve_data_config gives the model, in our terms: its resize is floor(crop / crop_pct), as
    timm's create_transform computes it."""
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


def load_model(name: str, pretrained: bool, ema: bool) -> Model:
    """Our checkpoint, an export folder, or a timm name (--pretrained)."""
    import timm

    from imagenet_elastic.train import tiny_models
    from imagenet_elastic.train.model import blur_strided_convs, create_model

    tiny_models.register()  # an export of a run that trained one names it in its config.json
    if os.path.isfile(name):
        from imagenet_elastic.checkpoint import store

        snapshot = store.load(name)
        weights = snapshot.get("model_ema") if ema else snapshot.get("model")
        if weights is None:
            raise UserError(f"checkpoint {name} has no weight average (it was trained without --model-ema): "
                            "evaluate it without --ema" if ema else f"checkpoint {name} holds no model weights")
        classes = tuple(snapshot["classes"])
        module = create_model(snapshot["model_name"], len(classes), blurpool=saved_setting(snapshot["config"],
                                                                                              "blurpool"))
        module.load_state_dict(weights)
        settings = snapshot["config"]
        crop, resize = eval_sizes(settings["image_size"], settings.get("val_crop_size"), settings.get("val_resize"))
        own = dataclasses.replace(ours(crop), resize=resize)
        return Model(module, classes, own, crop)
    if ema:
        raise UserError("--ema applies to our checkpoints only")
    if os.path.isdir(name):
        config_file = os.path.join(name, "config.json")
        if not os.path.isfile(config_file):
            raise UserError(f"MODEL {name} is a folder without config.json: not an export (imagenet-elastic export)")
        try:
            with open(config_file) as f:
                exported = json.load(f)
            module = timm.create_model(f"local-dir:{name}", pretrained=True)
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            raise UserError(f"MODEL {name}: timm cannot load it ({str(error).splitlines()[0][:200]})") from None
        if exported.get("imagenet_elastic", {}).get("blurpool"):
            blur_strided_convs(module)
        classes = tuple(module.pretrained_cfg.get("label_names") or exported.get("label_names") or ())
    else:
        if not pretrained:
            raise UserError(f"MODEL {name} is neither a checkpoint file nor an export folder; a timm model name "
                            "needs --pretrained")
        try:
            module = timm.create_model(name, pretrained=True)
        except (RuntimeError, OSError, ValueError) as error:  # an unknown name; weights not found or not fetched
            raise UserError(f"MODEL {name}: timm cannot create it with --pretrained "
                            f"({(str(error).splitlines() or [type(error).__name__])[0][:200]})") from None
        classes = imagenet_classes(module)
    if len(classes) != module.num_classes:
        raise UserError(f"MODEL {name} names {len(classes)} classes for its {module.num_classes} outputs")
    own = timm_preprocessing(module, f"MODEL {name}")
    return Model(module, classes, own, own.crop)


def imagenet_classes(module: Any) -> tuple[str, ...]:
    """The wnids of a timm ImageNet model's outputs (n01440764, ...), as ImageNet's class folders name them."""
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset(module)
    if subset is None:
        raise UserError(f"timm model {module.default_cfg.get('architecture')} was not trained on an ImageNet "
                        f"subset timm knows: its {module.num_classes} classes have no names to match VAL's")
    return tuple(ImageNetInfo(subset).label_names())


class Relabelled(Source):
    """A validation source whose labels are positions in the scored classes (the model's, or a subset of them)."""

    def __init__(self, source: Source, labels: np.ndarray, classes: tuple[str, ...]) -> None:
        self.source, self.labels, self.classes, self.role = source, labels, classes, "val"

    def read(self, i: int) -> bytes:
        return self.source.read(i)

    def name(self, i: int) -> str:
        return self.source.name(i)

    def where(self) -> str:
        return self.source.where()

    def entries(self) -> np.ndarray:
        return self.source.entries()


def model_index(source: Source, classes: tuple[str, ...], where: str) -> np.ndarray:
    """Each of the source's classes as the model's output index: by name, or by number for folders numbered 0..N-1
    (ImageNet-V2's: folder 0 is the model's class 0)."""
    index = {name: k for k, name in enumerate(classes)}
    if all(name in index for name in source.classes):
        return np.array([index[name] for name in source.classes], dtype=np.int64)
    if all(name.isdigit() for name in source.classes):
        numbers = np.array([int(name) for name in source.classes], dtype=np.int64)
        if numbers.max() >= len(classes):
            raise UserError(f"VAL {where}: class folder {numbers.max()} is beyond the model's {len(classes)} classes")
        return numbers
    unknown = [name for name in source.classes if name not in index]
    raise UserError(f"VAL {where}: {len(unknown)} class(es) the model does not have, e.g. {unknown[:3]} (the model's "
                    f"classes run from {classes[0]!r} to {classes[-1]!r})")


def read_subset(path: str, classes: tuple[str, ...]) -> np.ndarray:
    """--class-subset: the model's output indices of the names the file lists, in the model's order."""
    index = {name: k for k, name in enumerate(classes)}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"--class-subset {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--class-subset {path} cannot be read: {getattr(error, 'strerror', None) or error}") \
            from None
    chosen = set()
    for number, line in enumerate(lines, start=1):
        name = line.strip()
        if not name:
            continue
        if name not in index:
            raise UserError(f"--class-subset {path} line {number}: {name!r} is not a class of the model "
                            f"({len(classes)} classes, from {classes[0]!r} to {classes[-1]!r})")
        chosen.add(index[name])
    if not chosen:
        raise UserError(f"--class-subset {path} names no class")
    return np.array(sorted(chosen), dtype=np.int64)


def read_real_labels(path: str) -> list[list[int]]:
    try:
        with open(path) as f:
            real = json.load(f)
    except FileNotFoundError:
        raise UserError(f"--real-labels {path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UserError(f"--real-labels {path} is not a JSON file: {getattr(error, 'strerror', None) or error}") \
            from None
    if not isinstance(real, list) or not all(isinstance(labels, list) and all(isinstance(k, int) for k in labels)
                                            for labels in real):
        raise UserError(f"--real-labels {path} is not a list of lists of class numbers (ReaL's real.json)")
    if len(real) > REAL_ENTRIES:
        raise UserError(f"--real-labels {path} has {len(real)} entries, ReaL's real.json {REAL_ENTRIES} (one per "
                        f"image of ImageNet's validation set): entry {REAL_ENTRIES + 1} and on name no image")
    return real


def check_real_classes(real: list[list[int]], path: str, classes: int) -> None:
    """Every class number of real.json is one of the model's (a number beyond them would be dropped unseen)."""
    for number, labels in enumerate(real, start=1):
        outside = [k for k in labels if not 0 <= k < classes]
        if outside:
            raise UserError(f"--real-labels {path} entry {number} (ILSVRC2012_val_{number:08d}): class {outside[0]} "
                            f"is out of range: the model has {classes} classes")


def real_sets(source: Source, real: list[list[int]], path: str, scored: np.ndarray) -> list[frozenset[int]]:
    """Each image's real labels, as positions among the scored classes (a label outside them cannot be
    predicted)."""
    position = {int(k): j for j, k in enumerate(scored)}
    found = []
    for i in range(len(source)):
        match = REAL_NAME.search(os.path.basename(source.name(i)))
        if match is None:
            raise UserError(f"--real-labels: {source.name(i)} is not named as ImageNet's validation images "
                            "(ILSVRC2012_val_NNNNNNNN), so it has no entry in " + path)
        number = int(match.group(1))
        if not 1 <= number <= len(real):
            raise UserError(f"--real-labels {path} has {len(real)} entries: none for {source.name(i)}")
        found.append(frozenset(position[k] for k in real[number - 1] if k in position))
    return found


def real_counts(sets: list[frozenset[int]]) -> Any:
    """ReaL's sums per batch: images right, images counted (a non-empty list of real labels)."""
    import torch

    from imagenet_elastic.train.step import Counts

    def count(logits: torch.Tensor, batch: Any) -> torch.Tensor:
        top1 = logits.argmax(1).tolist()
        rows = [sets[i] for i in batch.indices.tolist()]
        right = sum(1 for guess, labels in zip(top1, rows) if labels and guess in labels)
        return torch.tensor([right, sum(1 for labels in rows if labels)], dtype=torch.float64)

    return Counts(("real_right", "real_images"), count)


def check_val_exists(locations: Sequence[str]) -> None:
    """Each VAL names a folder or a shard pattern (said before the model is loaded; the trainer's message for a
    missing folder would point at its --val-path)."""
    from imagenet_elastic.data.sources import tar_shards

    for location in locations:
        if not os.path.exists(location) and not tar_shards.is_pattern(location):
            raise UserError(f"VAL {location} does not exist: evaluate takes class folders, a flat folder of images "
                            "with --val-labels, or tar shards (a folder or a pattern)")


def labels_file(location: str, val_labels: str | None) -> str | None:
    """--val-labels names the classes of the flat folders among VAL (image files, no folders), not of the others."""
    from imagenet_elastic.data.sources import tar_shards

    if val_labels is None or not os.path.isdir(location) or tar_shards.claims(location):
        return None
    return None if any(entry.is_dir() for entry in os.scandir(location)) else val_labels


def run(args: Any) -> list[dict[str, Any]]:
    import torch

    from imagenet_elastic.data import pipeline, sources
    from imagenet_elastic.data.augment import INCEPTION_CROP
    from imagenet_elastic.data.decoding import Decoding
    from imagenet_elastic.data.feed import device_batches
    from imagenet_elastic.data.model_input import ModelInput
    from imagenet_elastic.launch import distributed
    from imagenet_elastic.launch.launchers import resolve_launch
    from imagenet_elastic.report.console import Console
    from imagenet_elastic.train import build
    from imagenet_elastic.train.model import place_model, resolve_precision
    from imagenet_elastic.train.step import evaluate

    env = resolve_launch("env", os.environ).env
    console = Console(env.is_main)
    distributed.configure_threads(None, env.local_world_size)
    device = distributed.select_device(args.device, env)
    check_val_exists(args.val)
    real = read_real_labels(args.real_labels) if args.real_labels else None
    model = load_model(args.model, args.pretrained, args.ema)
    if real is not None:
        check_real_classes(real, args.real_labels, len(model.classes))
    prep = model.own if args.preprocessing == "model" else ours(model.input_size)
    scored = (read_subset(args.class_subset, model.classes) if args.class_subset
              else np.arange(len(model.classes), dtype=np.int64))
    position = np.full(len(model.classes), -1, dtype=np.int64)
    position[scored] = np.arange(len(scored))
    sets = []
    for location in args.val:
        source = sources.open_source(location, "val", None, model.classes, labels_file(location, args.val_labels))
        labels = position[model_index(source, model.classes, location)[source.labels]]
        if (labels < 0).any():
            outside = source.name(int(np.flatnonzero(labels < 0)[0]))
            raise UserError(f"VAL {location}: {outside} is of a class outside --class-subset {args.class_subset}")
        relabelled = Relabelled(source, labels, tuple(model.classes[k] for k in scored))
        sets.append((location, relabelled, real_sets(source, real, args.real_labels, scored) if real else None))
    precision = resolve_precision(args.amp, device)
    if precision.warning:
        console.warn(precision.warning)
    cores = distributed.available_cores()
    decoding = Decoding.choose(args.decode, device, cores // max(1, env.local_world_size), INCEPTION_CROP,
                               args.gpu_decoder)
    workers = args.workers if args.workers is not None else decoding.default_workers(cores, env.local_world_size)
    if decoding.warning(device):
        console.warn(decoding.warning(device))
    decoder = decoding.finisher(device, functools.partial(console.warn, every_rank=True))
    loaders = []
    pinned = device.type == "cuda"
    batch = pipeline.batch_bytes(args.batch_size, prep.crop, decoding.mode == "gpu")
    prefetch = pipeline.prefetch_factor(workers, batch, pinned)  # the sets are read one after another: one budget
    with contextlib.ExitStack() as stack:
        for _, source, _ in sets:
            dataset = pipeline.EvalDataset(source, prep.crop, prep.resize, decoding.eval_load, prep.interpolation)
            loaders.append(pipeline.eval_loader(dataset, args.batch_size, env.rank, env.world_size, workers, pinned,
                                                collate_fn=decoding.collate, prefetch=prefetch))
        build.start_loader_workers(loaders, stack)  # before the process group's threads, as the trainer does
        build.join_process_group(env, device, args.dist_timeout, stack)
        module = place_model(model.module, device, args.channels_last)
        to = ModelInput(device, precision.dtype, args.channels_last,
                        normalisation=(tuple(m * 255 for m in prep.mean), tuple(s * 255 for s in prep.std)))
        columns = None if args.class_subset is None else torch.from_numpy(scored).to(device)
        rows = []
        for (location, _, real_of), loader in zip(sets, loaders):
            counts = real_counts(real_of) if real_of is not None else None
            result = evaluate(to, module, device_batches(loader, device, decoder), args.flip_average, columns, counts)
            row: dict[str, Any] = {"model": args.model, "val": location, "images": result.samples,
                                   "top1": result.top1, "top5": result.top5, "loss": result.loss}
            if counts is not None:
                seen = result.counts["real_images"]
                row.update(real_top1=100 * result.counts["real_right"] / max(seen, 1.0), real_images=int(seen))
            if args.class_subset:
                row["classes"] = len(scored)
            if args.flip_average:
                row["flip_average"] = True
            row.update(preprocessing=args.preprocessing, **prep.describe(), precision=precision.name,
                       world_size=env.world_size)
            console.result(row)
            rows.append(row)
        if len(rows) > 1:
            console.table("scores", [(row["val"], summary(row)) for row in rows])
    return rows


def summary(row: dict[str, Any]) -> str:
    real = f", ReaL {row['real_top1']:.2f}%" if "real_top1" in row else ""
    return f"top-1 {row['top1']:.2f}%  top-5 {row['top5']:.2f}%{real}  ({row['images']} images)"


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except UserError as error:
        report(error, rank=int(os.environ.get("RANK", "0")))
        sys.exit(error.exit_code)

