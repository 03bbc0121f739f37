"""A timm model as a run, a checkpoint or an export needs it, its weight average (EMA), and the image sizes it must
take, with timm's options that make a model built for one input size (ViT, DeiT, Swin, ...) take them."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from imagenet_elastic.config import WEIGHT_SOURCES, saved_eval_sizes
from imagenet_elastic.errors import UserError
from imagenet_elastic.models import tiny_models
from imagenet_elastic.models.blurpool import BLUR_MIN_CHANNELS, blur_strided_convs

if TYPE_CHECKING:
    from imagenet_elastic.config import Config

Sizes = Sequence[tuple[int, str]]  # image sizes in pixels, each with the flag that asks for it


def check_model_name(name: str, named: Optional[str] = None) -> None:
    """A misspelt --model (or `named`: a checkpoint's), with timm's closest names; asked before the data scan."""
    import timm  # slow to import: deferred so that input errors are reported at once

    tiny_models.register()
    if name.startswith(WEIGHT_SOURCES):  # the architecture is in the source's config.json: checked as it is read
        return
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models()"
        raise UserError(f"{named or f'--model {name!r}'} is not a timm model{hint}")
    arch, _, tag = name.partition(".")
    known = timm.list_pretrained(f"{arch}.*") if tag else [name]
    if name not in known:  # is_model ignores the tag
        tags = [other.split(".", 1)[1] for other in known]
        hint = f"; its tags: {', '.join(tags[:6])}{' ...' if len(tags) > 6 else ''}" if tags else "; it has none"
        raise UserError(f"{named or f'--model {name!r}'}: timm knows no tag {tag!r} of {arch}{hint}")


def untrained_tag(name: str) -> Optional[str]:
    """The warning for a fresh run without --pretrained whose --model names published weights by their tag
    (`resnet18.a1_in1k`): timm builds the architecture alone, so the tag reads as a choice of weights that is not
    made. None for a name without a tag."""
    tag = name.partition(".")[2]
    return (f"--model {name} names timm's published weights {tag!r}, but --pretrained is off: the model starts "
            "from random weights (add --pretrained to start from them)") if tag else None


def create_model(name: str, num_classes: int, drop_path: float = 0.0, blurpool: bool = False,
                 published: Optional[Any] = None, grad_checkpointing: bool = False, sizes: Sizes = ()) -> nn.Module:
    """A timm model with random weights, or `published` ones (--pretrained's Weights, already read), loaded by timm's
    pretrained path with the tensors in hand: nothing is read twice, and timm drops a classifier of another class
    count. `blurpool`, `grad_checkpointing`, `sizes`: see blur_strided_convs, recompute_activations, input_options."""
    import timm

    check_model_name(name)
    extra: dict = {"drop_path_rate": drop_path} if drop_path else {}
    extra.update(input_options(name, sizes))
    weights: dict = {"pretrained": False} if published is None else {"pretrained": True, "pretrained_cfg_overlay": {
        "source": "", "state_dict": published.model.state_dict(), "num_classes": published.classes}}
    try:
        model = timm.create_model(name, num_classes=num_classes, **weights, **extra)
    except TypeError as error:
        if extra and "drop_path_rate" in str(error):
            raise UserError(f"--drop-path: timm's {name} has no drop_path_rate (no stochastic depth)") from None
        raise
    if blurpool and not blur_strided_convs(model):
        raise UserError(f"--blurpool: timm's {name} has no strided convolution with {BLUR_MIN_CHANNELS} or more "
                        "input channels to blur")
    if grad_checkpointing:
        recompute_activations(model, name)
    return model


def recompute_activations(model: nn.Module, name: str) -> None:
    """--grad-checkpointing: blocks run under torch.utils.checkpoint, recomputed in the backward with the forward's
    random state; batch norm would update its statistics again: the step freezes them (train/step.py)."""
    try:
        model.set_grad_checkpointing(True)
    except (AttributeError, NotImplementedError, AssertionError):
        raise UserError(f"--grad-checkpointing: timm's {name} does not support gradient checkpointing") from None
    if not getattr(model, "grad_checkpointing", True):
        raise UserError(f"--grad-checkpointing: timm's {name} does not support gradient checkpointing")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def create_ema(model: nn.Module, decay: float, warmup: bool) -> nn.Module:
    """timm's ModelEmaV3: a copy of `model` (as it is now) that `update(model, step)` moves towards it."""
    from timm.utils import ModelEmaV3

    return ModelEmaV3(model, decay=decay, use_warmup=warmup)


def run_sizes(config: Config, built_for: Optional[int] = None) -> tuple[tuple[int, str], ...]:
    """The sizes a run's model takes: validation's crop first (the size its weights are made for, unless
    `built_for`: a checkpoint's crop, at resume), then each epoch's training size."""
    crop = (config.eval_crop, "--val-crop-size" if config.val_crop_size else "--image-size")
    train = sorted({config.train_sizes(epoch) for epoch in range(config.epochs)})
    flag = "--progressive-resize" if config.progressive_resize else "--image-size"
    made = ((built_for, "the checkpoint's --val-crop-size"),) if built_for not in (None, config.eval_crop) else ()
    return (*made, crop, *((size, flag) for size in train))


def saved_sizes(settings: dict[str, Any]) -> tuple[tuple[int, str], ...]:
    """The size a checkpoint's model was made for (its run's validation crop), from its saved settings."""
    return ((saved_eval_sizes(settings)[0], "the checkpoint's --val-crop-size"),)


def input_options(name: str, sizes: Sizes) -> dict[str, Any]:
    """timm's `img_size` (sizing the position embeddings) / `dynamic_img_size` (resampling them per forward) that make
    model `name`, built by timm for one input size (ViT, DeiT, Swin, ...), take every size in `sizes` (the first: its
    weights'); {} where none is needed. Tried on meta-device copies; a model taking none is a UserError naming it,
    its size and the flag, before anything is read."""
    import timm

    wanted = list(dict.fromkeys(size for size, _ in sizes))
    if not wanted:
        return {}
    tiny_models.register()
    cfg = _pretrained_cfg(name)
    native = tuple(cfg.get("input_size", (3, 224, 224))[-2:])
    if not cfg.get("fixed_input_size") or all((size, size) == native for size in wanted):
        return {}
    built = wanted[0]
    made = {} if (built, built) == native else {"img_size": built}
    others: list[int] = []  # sizes refused by a model that took the first
    as_timm_builds = None
    for options in ({}, *([made] if made else []), {**made, "dynamic_img_size": True}):
        try:
            with torch.device("meta"):
                model = timm.create_model(name, num_classes=1, pretrained=False, **options)
        except (TypeError, ValueError, AssertionError):  # an argument this architecture lacks, or a size it refuses
            continue
        as_timm_builds = as_timm_builds or model
        refused = next((size for size in wanted if not _takes(model, (size, size))), None)
        if refused is None:
            return options
        if refused != built:
            others.append(refused)
    if as_timm_builds is None or not _takes(as_timm_builds, native):
        return {}  # a forward the meta device cannot run tells nothing: the model is built as timm builds it
    flag = dict(reversed(sizes))  # the first flag that asks for each size
    side = f"{native[0]}" if native[0] == native[1] else f"{native[0]}x{native[1]}"
    refused = others[-1] if others else built
    patch, taken = _patch_multiples(as_timm_builds, refused)
    if taken:
        raise UserError(f"--model {name} takes sizes that are multiples of its {patch} px patches: timm cannot build "
                        f"it for {flag[refused]} {refused}; pass {flag[refused]} {' or '.join(map(str, taken))}")
    if others:
        raise UserError(f"--model {name} takes one image size (timm builds it for {side} px, or for another): it "
                        f"can be made for {flag[built]} {built} but then not for {flag[others[-1]]} {others[-1]}; "
                        "train and validate at one size, or choose a model that takes any size")
    raise UserError(f"--model {name} takes {side} px images only: timm cannot build it for {flag[built]} {built}; "
                    f"pass {flag[built]} {native[0]}, or choose a model that takes any size")


def _pretrained_cfg(name: str) -> dict[str, Any]:
    """timm's pretrained_cfg of a model name (its default tag's where it names none); for `hf-hub:` and `local-dir:`
    names, that of a meta-device copy built from their config.json."""
    import timm

    if not name.startswith(WEIGHT_SOURCES):
        try:
            return timm.models.get_pretrained_cfg(name).to_dict()
        except (RuntimeError, AttributeError):  # a name timm knows without a pretrained_cfg
            pass
    with torch.device("meta"):
        return dict(getattr(timm.create_model(name, num_classes=1, pretrained=False), "pretrained_cfg", {}) or {})


def _patch_multiples(model: nn.Module, size: int) -> tuple[int, list[int]]:
    """A model's square patch side, and the multiples of it next to `size` that the model takes: none where `size` is
    one or the model has no patches (its rule is then another)."""
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)  # timm's PatchEmbed: (height, width)
    side = patch[0] if isinstance(patch, tuple) and patch[0] == patch[1] else 0
    if not side or size % side == 0:
        return side, []
    below = size - size % side
    return side, [near for near in (below, below + side) if near and _takes(model, (near, near))]


def _takes(model: nn.Module, size: tuple[int, int]) -> bool:
    """Whether a meta-device model runs a `size` (height, width) image in eval mode (shape checks fail there too)."""
    try:
        with torch.device("meta"), torch.no_grad():
            model.eval()(torch.empty(1, 3, *size))
    except (AssertionError, RuntimeError, ValueError):
        return False
    return True
