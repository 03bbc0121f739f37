"""`imagenet-elastic export CHECKPOINT OUT_DIR [--ema]`: a checkpoint's weights for timm and Hugging Face.

What it writes (timm's `save_for_hf`, with our validation's preprocessing as `pretrained_cfg`) and how timm loads it:
docs/OUTPUTS.md ("After training").
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence

from imagenet_elastic.atomic_files import nearest_existing, process_umask, storage_error
from imagenet_elastic.checkpoint import store
from imagenet_elastic.config import saved_eval_sizes, saved_setting
from imagenet_elastic.data.model_input import IMAGENET_MEAN_FRACTIONS, IMAGENET_STD_FRACTIONS
from imagenet_elastic.errors import StorageError, UserError, first_line, report
from imagenet_elastic.options import HelpFormatter, Parser

# gives a model timm rebuilt from a --blurpool run's export its blur back
BLURPOOL_CALL = "from imagenet_elastic.models.blurpool import blur_strided_convs; blur_strided_convs(model)"


def build_parser() -> Parser:
    p = Parser(prog="imagenet-elastic export", description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint of ours (best.pt, last.pt, epoch_NNNN.pt), "
                   "or a run's checkpoints folder: its best.pt")
    p.add_argument("out_dir", metavar="OUT_DIR", help="new or empty folder for model.safetensors and config.json")
    p.add_argument("--ema", action="store_true", help="export the weight average (--model-ema) instead of the "
                   "raw weights")
    return p


def crop_fraction(crop: int, resize: int) -> float:
    """crop / resize, nudged down where needed so that timm's floor(crop / crop_pct) gives back `resize`."""
    fraction = crop / resize
    while math.floor(crop / fraction) < resize:
        fraction = math.nextafter(fraction, 0.0)
    return fraction


def remove_folders(folders: list[str]) -> None:
    for folder in folders:  # deepest first; rmdir removes only an empty one: never what another wrote meanwhile
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def write_folder(out_dir: str, write: Callable[[str], None]) -> None:
    """OUT_DIR whole or not at all: `write` fills a temp folder beside it, renamed to OUT_DIR once complete (an empty
    OUT_DIR the user made is kept: the temp folder is made inside it, so a mount point or a parent we may not write
    works, and the files move up, config.json last); a failure leaves nothing behind, the parent folders it made
    included. The OS's refusal (no space, quota) is one line naming OUT_DIR."""
    from safetensors import SafetensorError  # safetensors words the OS's refusal its own way

    existing = os.path.isdir(out_dir)  # empty, as export checked
    parent = out_dir if existing else os.path.dirname(os.path.abspath(out_dir))
    made, folder, first = [], os.path.abspath(parent), nearest_existing(parent)  # what makedirs makes, deepest first
    while folder != first:
        made.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        # not atomic_files.TEMP_PREFIX: a run whose checkpoints folder holds OUT_DIR would remove it as its own
        temp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}-export-", dir=parent)
    except OSError as error:
        remove_folders(made)
        raise storage_error(error, "making", out_dir) from None
    try:
        write(temp)
        for name in os.listdir(temp):  # safetensors writes 0600: a model to share is readable like our checkpoints
            os.chmod(os.path.join(temp, name), 0o666 & ~process_umask())
        os.chmod(temp, 0o777 & ~process_umask())  # mkdtemp's 0700 likewise
        if existing:
            for name in sorted(os.listdir(temp), key=lambda name: name == "config.json"):
                os.replace(os.path.join(temp, name), os.path.join(out_dir, name))
            os.rmdir(temp)
        else:
            os.rename(temp, out_dir)
    except BaseException as error:  # Ctrl-C included
        shutil.rmtree(temp, ignore_errors=True)
        remove_folders(made)
        if isinstance(error, (OSError, SafetensorError)):
            raise StorageError(f"could not write export folder {out_dir}: "
                               f"{getattr(error, 'strerror', None) or first_line(error)[:200]}") from None
        raise


def export(path: str, out_dir: str, ema: bool) -> str:
    """Write OUT_DIR; returns what to tell the user."""
    if not out_dir:  # a script's unset variable
        raise UserError("export OUT_DIR is empty: give it a new or empty folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(f"export folder {out_dir} is not empty: choose a new or empty folder")
    if not os.path.isdir(existing := nearest_existing(out_dir)):  # OUT_DIR, or a folder it would be made in
        raise UserError(f"export folder {out_dir}: {existing} is not a folder")
    if os.path.isdir(path):  # as `evaluate` reads CHECKPOINT: a run's checkpoints folder stands for its best.pt
        if not os.path.isfile(os.path.join(path, store.BEST)):
            raise UserError(f"export CHECKPOINT {path} is a folder without {store.BEST}: pass one of its checkpoints "
                            "(last.pt, epoch_NNNN.pt)")
        path = os.path.join(path, store.BEST)
    snapshot = store.load(path)
    from timm.models import save_for_hf  # timm's public name for its Hugging Face writer

    from imagenet_elastic.models import tiny_models
    from imagenet_elastic.models.create import input_options, saved_sizes
    from imagenet_elastic.models.weights import saved_model

    model = saved_model(snapshot, path, ema, "export it")  # first: its one-line refusals of a file that is not ours
    classes, settings = list(snapshot["classes"]), snapshot.get("config", {})
    blurpool = saved_setting(settings, "blurpool")
    sizes = saved_sizes(settings)
    # a model timm builds for one input size (img_size): config.json's model_args make timm's local-dir: loader do so
    model_args = input_options(snapshot["model_name"], sizes)
    crop, resize = saved_eval_sizes(settings)  # our validation's preprocessing in timm's terms
    data_config = {"input_size": (3, crop, crop), "crop_pct": crop_fraction(crop, resize), "crop_mode": "center",
                   "interpolation": "bilinear", "mean": IMAGENET_MEAN_FRACTIONS, "std": IMAGENET_STD_FRACTIONS}
    # tag and license would otherwise be those of timm's own pretrained weights for this architecture
    model_config = {"label_names": classes, "pretrained_cfg": {**data_config, "tag": "imagenet_elastic",
                                                               "license": None}}
    if blurpool:  # timm ignores keys it does not know; a reader of config.json learns what the model needs
        model_config["imagenet_elastic"] = {"blurpool": True, "after_loading": BLURPOOL_CALL}
    accepted = inspect.signature(save_for_hf).parameters
    extra = {"data_config": data_config} if "data_config" in accepted else {}
    if model_args:
        if "model_args" not in accepted:
            raise UserError(f"{snapshot['model_name']} was made for {sizes[0][0]} px images, which this timm cannot "
                            "write in config.json (save_for_hf has no model_args): upgrade timm to export it")
        extra["model_args"] = model_args
    write_folder(out_dir, lambda folder: save_for_hf(model, folder, model_config=model_config,
                                                     safe_serialization=True, **extra))
    which = "weight average" if ema else "raw weights"
    hint = ("; its weight average scored best: add --ema to export that" if not ema and
            snapshot.get("best_of") == "model_ema" else "")
    # a tiny model of ours is in timm's registry only once registered
    register = ("from imagenet_elastic.models import tiny_models; tiny_models.register(); "
                if snapshot["model_name"] in tiny_models.NAMES else "")
    return (f"wrote {os.path.join(out_dir, 'model.safetensors')} ({snapshot['model_name']}, {len(classes)} classes, "
            f"{which} of epoch {snapshot['epoch']}{hint}) and config.json (input {data_config['input_size'][1]} px, "
            f"crop fraction {data_config['crop_pct']:.4f}, bilinear)\n"
            f"load it: import timm; {register}model = timm.create_model({json.dumps('local-dir:' + out_dir)}, "
            "pretrained=True)"
            + (f"\ntrained with --blurpool, which timm does not build: then {BLURPOOL_CALL}" if blurpool else ""))


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    try:
        print(export(args.checkpoint, args.out_dir, args.ema))
    except UserError as error:
        report(error, rank=0)
        sys.exit(error.exit_code)
