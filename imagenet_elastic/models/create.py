"""A timm model as a run, a checkpoint or an export needs it: its name checked, random or published weights, stochastic
depth, BlurPool, checkpointed blocks, the sizes it takes; its weight average (EMA)."""

from __future__ import annotations

import difflib
from typing import Any, Optional

from torch import nn

from imagenet_elastic.config import WEIGHT_SOURCES
from imagenet_elastic.errors import UserError
from imagenet_elastic.models import tiny_models
from imagenet_elastic.models.blurpool import BLUR_MIN_CHANNELS, blur_strided_convs
from imagenet_elastic.models.input_size import Sizes, input_options


def check_model_name(name: str) -> None:
    """A misspelt --model, with timm's closest names; asked before the data scan and the checkpoints folder."""
    import timm  # slow to import: deferred so that input errors are reported at once

    tiny_models.register()
    if name.startswith(WEIGHT_SOURCES):  # the architecture is in the source's config.json: checked as it is read
        return
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models()"
        raise UserError(f"--model {name!r} is not a timm model{hint}")


def create_model(name: str, num_classes: int, drop_path: float = 0.0, blurpool: bool = False,
                 published: Optional[Any] = None, grad_checkpointing: bool = False, sizes: Sizes = ()) -> nn.Module:
    """A timm model with random weights, or `published` ones (--pretrained's, already read: weights.py's Weights,
    which imports this module), loaded by timm's pretrained path with the tensors in hand, so nothing is read twice
    and timm drops a classifier of another class count;
    `blurpool`, `grad_checkpointing` and `sizes`: see blur_strided_convs, recompute_activations and input_options."""
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
