"""Model and optimizer construction."""

from __future__ import annotations

import difflib
from typing import Optional

import torch
from torch import nn

from imagenet_elastic.errors import UserError


def create_model(name: str, num_classes: int) -> nn.Module:
    """A timm model with random weights (runs never download anything)."""
    import timm  # ~2 s to import: deferred so that input errors are reported at once
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models()"
        raise UserError(f"--model {name!r} is not a timm model{hint}")
    return timm.create_model(name, pretrained=False, num_classes=num_classes)


def resolve_amp(amp: str, device: torch.device) -> Optional[torch.dtype]:
    """bf16 where the hardware has it (every CPU, Ampere and newer GPUs), else fp16."""
    if amp == "auto":
        amp = "bf16" if device.type == "cpu" or torch.cuda.is_bf16_supported() else "fp16"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


def resolve_channels_last(requested: Optional[bool], device: torch.device) -> bool:
    """--channels-last as given, else on for CUDA (NHWC convolutions), off on CPU."""
    return requested if requested is not None else device.type == "cuda"


def place_model(model: nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    """The model as training runs it. On CUDA cuDNN also picks its fastest kernels once: input
    shapes are fixed."""
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weights of convolutions and linear layers, none on norms and biases."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def create_optimizer(model: nn.Module, lr: float, momentum: float, weight_decay: float,
                     device: torch.device) -> torch.optim.Optimizer:
    """On CUDA the fused SGD kernel (a few launches for all parameters), elsewhere torch's default."""
    fused = True if device.type == "cuda" else None
    return torch.optim.SGD(param_groups(model, weight_decay), lr=lr, momentum=momentum, fused=fused)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
