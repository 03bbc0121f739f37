"""The optimizer: which ones --opt offers, their parameter groups, and the rules their state follows when it
is loaded from a checkpoint (its own kernels, its parameters' memory layout, no unwritten momentum)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional

from imagenet_elastic import options
from imagenet_elastic.errors import UserError
from imagenet_elastic.options import option

if TYPE_CHECKING:
    import torch
    from torch import nn


class OptimizerInfo(NamedTuple):
    maker: str  # who builds it: torch's SGD, or timm's create_optimizer_v2 by this name
    takes_momentum: bool  # whether --momentum applies
    help: str  # for --opt's help


# --opt's choices. Nothing heavy is imported here: the command line reads this table.
OPTIMIZERS: dict[str, OptimizerInfo] = {
    "sgd": OptimizerInfo("torch", True, "torch's, fused on CUDA"),
    "nesterov": OptimizerInfo("timm", True, "SGD with Nesterov momentum, timm's"),
    "adamw": OptimizerInfo("timm", False, "timm's"),
    "lamb": OptimizerInfo("timm", False, "timm's, for large batches"),
    "lars": OptimizerInfo("timm", True, "timm's, for large batches"),
}


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer (one of `OPTIMIZERS`), its LR and what it applies to."""

    lr: float = option(0.1, "LR for a global batch of 256, scaled linearly: `lr x global_batch / 256` (printed at "
                       "start)", "model", "X", type=options.positive_float, exact=True)
    opt: str = option("sgd", "optimizer: " + options.described(OPTIMIZERS), "model", choices=list(OPTIMIZERS),
                      exact=True)
    momentum: float = option(0.9, "momentum of sgd, nesterov and lars", "model", "X",
                             type=options.non_negative_float, exact=True)
    weight_decay: float = option(1e-4, "not applied to 1-D parameters (norm layers' weights and every bias) nor to "
                                 "those timm's model.no_weight_decay() names (a ViT's pos_embed and cls_token)",
                                 "model", "X", type=options.non_negative_float, exact=True)
    layer_decay: Optional[float] = option(
        None, "layer-wise LR decay (BEiT's, timm's --layer-decay) for fine-tuning: the LR of layer i of the L the "
        "model's group_matcher numbers is scaled by X^(L-1-i), the head's by 1", "model", "X",
        type=options.positive_float, exact=True)
    clip_grad_norm: Optional[float] = option(None, "scale each step's gradient (the global batch's) down to this total "
                                             "L2 norm where it is larger (torchvision's --clip-grad-norm; ViT/DeiT "
                                             "recipes use 1.0)", "model", "X", type=options.positive_float, exact=True)


def param_groups(model: nn.Module, weight_decay: float, layer_decay: Optional[float] = None) -> list[dict]:
    """timm's parameter groups, as its create_optimizer_v2 builds them, each also listing its `param_names` (saved in
    the state dict) so that a saved state finds its parameters by name when the grouping changed."""
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    if layer_decay is None:
        groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip)
    else:
        groups = param_groups_layer_decay(model, weight_decay, no_weight_decay_list=skip, layer_decay=layer_decay)
    names = {id(param): name for name, param in model.named_parameters()}
    return [{**group, "param_names": [names[id(p)] for p in group["params"]]} for group in groups]


def check_layer_decay(model: nn.Module, model_name: str) -> None:
    """--layer-decay needs the model's own layer numbering (`group_matcher`): timm's fallback means nothing."""
    if not hasattr(model, "group_matcher"):
        raise UserError(f"--layer-decay: timm's {model_name} has no group_matcher (its layers are not numbered); "
                        "leave --layer-decay out for this model")


def legacy_groups(model: nn.Module) -> list[list[str]]:
    """Checkpoints' grouping before timm's groups: parameters of 2+ dimensions (decayed) first, the rest second."""
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    return [[name for name, param in trained if param.ndim > 1], [name for name, param in trained if param.ndim <= 1]]


def regroup(legacy: list[list[str]], optimizer: torch.optim.Optimizer, state_dict: dict) -> Optional[dict]:
    """A saved state grouped otherwise (`legacy`, or another grouping rule) rearranged by parameter name.
    `Optimizer.load_state_dict` pairs parameters by position alone, and would refuse the groups' sizes or, worse,
    hand one parameter's momentum to another. A state of other parameters is refused."""
    own, saved = optimizer.param_groups, state_dict["param_groups"]
    saved_names = [group.get("param_names") for group in saved]
    own_names = [group["param_names"] for group in own]
    if saved_names == own_names:
        return None  # the same grouping: loaded as saved
    if any(names is None for names in saved_names):
        saved_names = legacy
    fits = len(saved_names) == len(saved) and all(
        len(names) == len(group["params"]) for names, group in zip(saved_names, saved))
    if not fits or sorted(sum(saved_names, [])) != sorted(sum(own_names, [])):
        raise ValueError("the checkpoint's optimizer state holds other parameters than this model's")
    name_of = {index: name for names, group in zip(saved_names, saved) for index, name in zip(group["params"], names)}
    where = {name: index for index, name in enumerate(sum(own_names, []))}
    groups = [{**group, "params": [where[name] for name in names]} for group, names in zip(own, own_names)]
    state = {where[name_of[index]]: value for index, value in state_dict["state"].items()}
    return {**state_dict, "state": state, "param_groups": groups}


def create_optimizer(model: nn.Module, lr: float, momentum: float, weight_decay: float,
                     device: torch.device, name: str = "sgd", fused: Optional[bool] = None,
                     layer_decay: Optional[float] = None) -> torch.optim.Optimizer:
    """The optimizer OPTIMIZERS names, over `param_groups`; torch's SGD is fused on CUDA unless `fused` says no."""
    import torch

    maker, takes_momentum, _ = OPTIMIZERS[name]
    extra = {"momentum": momentum} if takes_momentum else {}
    groups = param_groups(model, weight_decay, layer_decay)
    if maker == "torch":
        fused = device.type == "cuda" if fused is None else fused
        optimizer = torch.optim.SGD(groups, lr=lr, fused=fused or None, **extra)
    else:
        from timm.optim import create_optimizer_v2

        optimizer = create_optimizer_v2(groups, opt=name, lr=lr, weight_decay=weight_decay, **extra)
    optimizer.register_load_state_dict_pre_hook(functools.partial(regroup, legacy_groups(model)))
    optimizer.register_load_state_dict_pre_hook(keep_own_settings)
    optimizer.register_load_state_dict_post_hook(follow_parameter_layout)
    optimizer.register_load_state_dict_post_hook(zero_momentum)
    zero_momentum(optimizer)
    return optimizer


def keep_own_settings(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A loaded state keeps each group's settings as this run made them, not as saved (a changed --weight-decay's old
    value; a GPU's fused kernel on a CPU resume); what an optimizer counts in its groups (LAMB's `step`) is loaded."""
    groups = [{**saved, **{k: v for k, v in own.items() if k != "params"}}
              for saved, own in zip(state_dict["param_groups"], optimizer.param_groups)]
    return {**state_dict, "param_groups": groups}


def follow_parameter_layout(optimizer: torch.optim.Optimizer) -> None:
    """Each state tensor of its parameter's shape takes the parameter's strides, as a first step would: after
    `Optimizer.load_state_dict` (dtype and device only) a state saved NCHW (or packed by load-once) beside channels_last
    parameters fails CUDA's fused kernels, which refuse unequal strides (`check_fast_path_restrictions`)."""
    import torch

    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if (isinstance(value, torch.Tensor) and value.shape == param.shape
                        and value.stride() != param.stride()):
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def zero_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Fused SGD's momentum buffers as zeros wherever none exists yet. Otherwise fused SGD makes them with `empty_like`
    in its first step and leaves them unwritten when GradScaler finds an inf (the kernel returns early; common at
    fp16's initial scale): the next step computes 0.9 x garbage + g. From zeros, the first real step writes g, bit for
    bit. Unfused optimizers never step on an inf (GradScaler skips)."""
    import torch

    for group in optimizer.param_groups:
        if not (isinstance(optimizer, torch.optim.SGD) and group.get("fused") and group.get("momentum")):
            continue
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
