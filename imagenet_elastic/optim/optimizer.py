"""The optimizer: which ones --opt offers, their parameter groups, and the rules their state follows when it
is loaded from a checkpoint (its own kernels, its parameters' memory layout, no unwritten momentum)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional

from imagenet_elastic import options
from imagenet_elastic.options import option

if TYPE_CHECKING:
    import torch
    from torch import nn


class OptimizerInfo(NamedTuple):
    maker: str  # who builds it: torch's SGD, or timm's create_optimizer_v2 by this name
    takes_momentum: bool  # whether --momentum applies
    help: str  # for --opt's help


# --opt: kept here once; config offers these names with their help. Nothing heavy is imported here: the command
# line reads this table. A new optimizer is a line here.
OPTIMIZERS: dict[str, OptimizerInfo] = {
    "sgd": OptimizerInfo("torch", True, "torch's, fused on CUDA"),
    "nesterov": OptimizerInfo("timm", True, "SGD with Nesterov momentum, timm's"),
    "adamw": OptimizerInfo("timm", False, "timm's"),
    "lamb": OptimizerInfo("timm", False, "timm's, for large batches"),
    "lars": OptimizerInfo("timm", True, "timm's, for large batches"),
}


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer (one of `OPTIMIZERS`), its LR and what it applies to. Declared beside what they choose
    from; config.Config gathers every folder's settings."""

    lr: float = option(0.1, "LR for a global batch of 256, scaled linearly: `lr x global_batch / 256` (printed at "
                       "start)", "model", "X", type=options.positive_float)
    opt: str = option("sgd", "optimizer: " + options.described(OPTIMIZERS), "model", choices=list(OPTIMIZERS))
    momentum: float = option(0.9, "momentum of sgd, nesterov and lars", "model", "X",
                             type=options.non_negative_float)
    weight_decay: float = option(1e-4, "not applied to 1-D parameters (norm layers' weights and every bias) nor to "
                                 "those timm's model.no_weight_decay() names (a ViT's pos_embed and cls_token)",
                                 "model", "X",
                                 type=options.non_negative_float)
    layer_decay: Optional[float] = option(
        None, "layer-wise LR decay (BEiT's, timm's --layer-decay) for fine-tuning: the LR of layer i of the L the "
        "model's group_matcher numbers is scaled by X^(L-1-i), the head's by 1", "model", "X",
        type=options.positive_float)
    clip_grad_norm: Optional[float] = option(
        None, "scale each step's gradient (the global batch's) down to this total L2 norm where it is larger "
        "(torchvision's --clip-grad-norm; ViT/DeiT recipes use 1.0)", "model", "X", type=options.positive_float)


def param_groups(model: nn.Module, weight_decay: float, layer_decay: Optional[float] = None) -> list[dict]:
    """timm's parameter groups, as its create_optimizer_v2 builds them from a model: weight decay on every parameter
    but 1-D ones (norm layers' weights, biases) and those the model's `no_weight_decay()` names (a ViT's position
    embedding and class token, as in timm's and DeiT's recipes); with `layer_decay`, timm's layer-wise groups
    (BEiT's LR decay: the model's `group_matcher` numbers its layers, each group has an `lr_scale`).

    Each group also lists its parameters' names (`param_names`, which torch saves in the optimizer's state dict),
    so that a saved state finds its parameters by name when the grouping changed (`regroup`)."""
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    if layer_decay is None:
        groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip)
    else:
        groups = param_groups_layer_decay(model, weight_decay, no_weight_decay_list=skip, layer_decay=layer_decay)
    names = {id(param): name for name, param in model.named_parameters()}
    return [{**group, "param_names": [names[id(p)] for p in group["params"]]} for group in groups]


def check_layer_decay(model: nn.Module, model_name: str) -> None:
    """--layer-decay needs the model's own numbering of its layers: timm's fallback (fixed-size runs of
    parameters) means nothing for an architecture, so a model without a `group_matcher` is refused."""
    if not hasattr(model, "group_matcher"):
        from imagenet_elastic.errors import UserError

        raise UserError(f"--layer-decay: timm's {model_name} has no group_matcher (its layers are not numbered); "
                        "leave --layer-decay out for this model")


def legacy_groups(model: nn.Module) -> list[list[str]]:
    """The grouping of checkpoints written before timm's groups (`param_groups` until November 2026): every
    parameter of two or more dimensions decayed, in the first group, the others in the second, without names."""
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    return [[name for name, param in trained if param.ndim > 1], [name for name, param in trained if param.ndim <= 1]]


def regroup(legacy: list[list[str]], optimizer: torch.optim.Optimizer, state_dict: dict) -> Optional[dict]:
    """A saved state grouped otherwise than this optimizer (a checkpoint written before timm's groups, whose
    grouping `legacy` gives; or one of another grouping rule) is rearranged by parameter name: each parameter's
    state (momentum, moments) goes to where this optimizer keeps that parameter, and each group keeps this
    run's own settings. `Optimizer.load_state_dict` pairs parameters by position alone, and would refuse the
    groups' sizes or, worse, hand one parameter's momentum to another. A state of other parameters is refused."""
    own = optimizer.param_groups
    saved = state_dict["param_groups"]
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
    groups, start = [], 0
    for group in own:
        count = len(group["params"])
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": list(range(start, start + count))})
        start += count
    state = {where[name_of[index]]: value for index, value in state_dict["state"].items()}
    return {**state_dict, "state": state, "param_groups": groups}


def create_optimizer(model: nn.Module, lr: float, momentum: float, weight_decay: float,
                     device: torch.device, name: str = "sgd", fused: Optional[bool] = None,
                     layer_decay: Optional[float] = None) -> torch.optim.Optimizer:
    """The optimizer OPTIMIZERS names, over timm's parameter groups (`param_groups`). torch's SGD is fused on CUDA
    (a few launches for all parameters; `fused` overrides that). A state loaded from a checkpoint finds its
    parameters by name (`regroup`), keeps this run's group settings (`keep_own_settings`) and its parameters' memory
    layout (`follow_parameter_layout`), and fused SGD's momentum exists before its first step (`zero_momentum`)."""
    import functools

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
    """A loaded state keeps each group's settings as this run made them: what its command line asks for (weight
    decay, --layer-decay's LR scales, momentum, betas, ...) and the kernels its device runs (a GPU checkpoint's
    fused kernel is not for a CPU resume, nor the reverse). The checkpoint gives what training wrote: each
    parameter's state (momentum, moments) and what an optimizer counts in its groups (timm's LAMB: `step`).

    `Optimizer.load_state_dict` would restore the saved settings too, so a resume with another --weight-decay
    would warn of the change (build.prepare_training) and then train with the old value. Resumed with the
    checkpoint's own settings, this changes nothing."""
    groups = [{**saved, **{k: v for k, v in own.items() if k != "params"}}
              for saved, own in zip(state_dict["param_groups"], optimizer.param_groups)]
    return {**state_dict, "param_groups": groups}


def follow_parameter_layout(optimizer: torch.optim.Optimizer) -> None:
    """Each per-parameter state tensor of its parameter's shape (momentum, Adam's moments) takes the
    parameter's strides, as a first step would have made it.

    `Optimizer.load_state_dict` casts dtype and device only, so a state saved NCHW (or packed contiguous
    by load-once, checkpoint/share.py, or saved by a run with the other --channels-last) would sit beside channels_last
    parameters and gradients, and CUDA's fused kernels refuse tensor lists of unequal strides
    (`check_fast_path_restrictions`): the first step after a resume would fail. A copy in the parameter's
    layout holds the same values.
    """
    import torch

    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if (isinstance(value, torch.Tensor) and value.shape == param.shape
                        and value.stride() != param.stride()):
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def zero_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Fused SGD's momentum buffers as zeros wherever none exists yet.

    Without them torch's fused SGD makes them with `empty_like` inside its first step and leaves them
    unwritten when GradScaler finds an inf on that step (the kernel returns early, common at fp16's
    initial scale): the next step would compute 0.9 x garbage + g. Starting from zeros, the first real
    step computes 0.9 x 0 + g = g, bit for bit what a first step writes, so nothing else changes.
    The unfused optimizers never step on an inf (GradScaler skips their `step`)."""
    import torch

    for group in optimizer.param_groups:
        if not (isinstance(optimizer, torch.optim.SGD) and group.get("fused") and group.get("momentum")):
            continue
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
