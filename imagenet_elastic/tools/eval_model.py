"""The model `imagenet-elastic evaluate` scores and its preprocessing: our checkpoint, an export folder or a timm
model with --pretrained, loaded with its classes and its own preprocessing (timm's resolve_data_config, or its run's
validation), and ours (the trainer's validation at a crop). Kept apart from the labels it is scored against
(eval_labels.py) and from the command's run (evaluate.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from imagenet_elastic.config import eval_sizes, saved_setting
from imagenet_elastic.data.pixels import INTERPOLATIONS
from imagenet_elastic.errors import UserError


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
    val_print: Optional[dict[str, Any]] = None  # our checkpoint's fingerprint of its run's validation split


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

    from imagenet_elastic.models import tiny_models
    from imagenet_elastic.models.blurpool import blur_strided_convs
    from imagenet_elastic.models.create import create_model
    from imagenet_elastic.models.input_size import saved_sizes

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
                                                                                              "blurpool"),
                              sizes=saved_sizes(snapshot["config"]))
        module.load_state_dict(weights)
        settings = snapshot["config"]
        crop, resize = eval_sizes(settings["image_size"], settings.get("val_crop_size"), settings.get("val_resize"))
        own = dataclasses.replace(ours(crop), resize=resize)
        return Model(module, classes, own, crop, (snapshot.get("data") or {}).get("val"))
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
