"""`imagenet-elastic export CHECKPOINT OUT_DIR [--ema]`: a checkpoint's weights for timm and Hugging Face.

Writes, with timm's `save_for_hf`, OUT_DIR/model.safetensors and OUT_DIR/config.json (with the preprocessing the
run's validation used as `pretrained_cfg`), so `timm.create_model("local-dir:OUT_DIR", pretrained=True)` rebuilds the
model and timm's data config preprocesses as our validation did. timm builds no blur: a --blurpool run's model needs
it back (the printed line says how).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
from collections.abc import Sequence

from imagenet_elastic.atomic_files import process_umask
from imagenet_elastic.checkpoint import store
from imagenet_elastic.config import saved_eval_sizes, saved_setting
from imagenet_elastic.data.model_input import IMAGENET_MEAN_FRACTIONS, IMAGENET_STD_FRACTIONS
from imagenet_elastic.errors import UserError, report
from imagenet_elastic.options import HelpFormatter, Parser

# gives a model timm rebuilt from a --blurpool run's export its blur back
BLURPOOL_CALL = "from imagenet_elastic.models.blurpool import blur_strided_convs; blur_strided_convs(model)"


def build_parser() -> Parser:
    p = Parser(prog="imagenet-elastic export", description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint of ours (best.pt, last.pt, epoch_NNNN.pt)")
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


def export(path: str, out_dir: str, ema: bool) -> str:
    """Write OUT_DIR; returns what to tell the user."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(f"export folder {out_dir} is not empty: choose a new or empty folder")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"export folder {out_dir} is a file")
    snapshot = store.load(path)
    from timm.models import save_for_hf  # timm's public name for its Hugging Face writer

    from imagenet_elastic.models import tiny_models
    from imagenet_elastic.models.create import input_options, saved_sizes
    from imagenet_elastic.models.weights import saved_model

    model = saved_model(snapshot, path, ema, "export it")
    classes = list(snapshot["classes"])
    blurpool = saved_setting(snapshot["config"], "blurpool")
    sizes = saved_sizes(snapshot["config"])
    # a model timm builds for one input size (img_size): config.json's model_args make timm's local-dir: loader do so
    model_args = input_options(snapshot["model_name"], sizes)
    crop, resize = saved_eval_sizes(snapshot["config"])  # our validation's preprocessing in timm's terms
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
    try:
        save_for_hf(model, out_dir, model_config=model_config, safe_serialization=True, **extra)
        for name in os.listdir(out_dir):  # safetensors writes 0600: a model to share is readable like our checkpoints
            os.chmod(os.path.join(out_dir, name), 0o666 & ~process_umask())
    except OSError as error:
        raise UserError(f"could not write {out_dir}: {error.strerror or error}") from None
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
