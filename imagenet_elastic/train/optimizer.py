"""The optimizer: which ones --opt offers, their parameter groups, and the rules their state follows when it
is loaded from a checkpoint (its own kernels, its parameters' memory layout, no unwritten momentum)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch
    from torch import nn

# --opt: who builds each (torch's SGD, or timm's create_optimizer_v2 by that name) and whether it takes --momentum.
# Kept here once; config offers these names. Nothing heavy is imported here: the command line reads this table.
OPTIMIZERS: dict[str, tuple[str, bool]] = {
    "sgd": ("torch", True),
    "nesterov": ("timm", True),
    "adamw": ("timm", False),
    "lamb": ("timm", False),
    "lars": ("timm", True),
}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on every parameter of two or more dimensions (convolutions, linear layers), none on 1-D ones
    (norm layers' weights and every bias)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def create_optimizer(model: nn.Module, lr: float, momentum: float, weight_decay: float,
                     device: torch.device, name: str = "sgd", fused: Optional[bool] = None) -> torch.optim.Optimizer:
    """The optimizer OPTIMIZERS names, over the same parameter groups: no weight decay on norms and biases.
    torch's SGD is fused on CUDA (a few launches for all parameters; `fused` overrides that). Every
    optimizer's state keeps its parameters' layout whatever it is loaded from (`follow_parameter_layout`), and
    fused SGD's momentum exists before its first step (`zero_momentum`)."""
    import torch

    maker, takes_momentum = OPTIMIZERS[name]
    extra = {"momentum": momentum} if takes_momentum else {}
    if maker == "torch":
        fused = device.type == "cuda" if fused is None else fused
        optimizer = torch.optim.SGD(param_groups(model, weight_decay), lr=lr, fused=fused or None, **extra)
    else:
        from timm.optim import create_optimizer_v2

        optimizer = create_optimizer_v2(param_groups(model, weight_decay), opt=name, lr=lr,
                                        weight_decay=weight_decay, **extra)
    optimizer.register_load_state_dict_pre_hook(keep_own_kernels)
    optimizer.register_load_state_dict_post_hook(follow_parameter_layout)
    optimizer.register_load_state_dict_post_hook(zero_momentum)
    zero_momentum(optimizer)
    return optimizer


KERNEL_CHOICES = ("fused", "foreach")  # optimizer options that belong to the device, not to the run


def keep_own_kernels(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A loaded state keeps this optimizer's kernel choices: a GPU checkpoint's fused kernel is not for a
    CPU resume, nor the reverse."""
    groups = [{**saved, **{k: own[k] for k in KERNEL_CHOICES if k in own}}
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
