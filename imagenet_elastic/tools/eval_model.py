"""The model `imagenet-elastic evaluate` scores: our checkpoint, an export folder or a timm model with --pretrained,
with its classes and its own preprocessing, and ours (the trainer's validation at a crop)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from imagenet_elastic.config import eval_sizes, saved_eval_sizes
from imagenet_elastic.data.pixels import INTERPOLATIONS
from imagenet_elastic.errors import UserError


@dataclass(frozen=True)
class Preprocessing:
    crop: int
    resize: int
    interpolation: str
    mean: tuple[float, ...]  # as timm gives them: on 0-1 values
    std: tuple[float, ...]

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Mean and std on 0-255 levels, as data/model_input.ModelInput takes them."""
        return tuple(m * 255 for m in self.mean), tuple(s * 255 for s in self.std)

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
    from imagenet_elastic.data.model_input import IMAGENET_MEAN_FRACTIONS, IMAGENET_STD_FRACTIONS
    return Preprocessing(crop, eval_sizes(crop, None, None)[1], "bilinear", IMAGENET_MEAN_FRACTIONS,
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


def load_model(name: str, pretrained: bool, ema: bool) -> Model:
    """Our checkpoint, an export folder, or a timm name (--pretrained), read by models/weights.py."""
    from imagenet_elastic.models import weights

    loaded = weights.load_weights(name, "MODEL", ema, published=pretrained)
    kind = loaded.kind
    if kind == weights.CHECKPOINT:
        crop, resize = saved_eval_sizes(loaded.settings)
        own = dataclasses.replace(ours(crop), resize=resize)
        return Model(loaded.model, loaded.class_names, own, crop, loaded.val_print)
    module = loaded.model
    classes = ((loaded.class_names or tuple(module.pretrained_cfg.get("label_names") or ())) if kind == weights.EXPORT
               else imagenet_classes(module))
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
