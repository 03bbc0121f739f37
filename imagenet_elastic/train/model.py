"""Model and optimizer construction."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from imagenet_elastic.config import eval_sizes, saved_setting
from imagenet_elastic.errors import UserError
from imagenet_elastic.train import tiny_models

if TYPE_CHECKING:
    from imagenet_elastic.checkpoint.published import Published
    from imagenet_elastic.config import Config


def check_model_name(name: str) -> None:
    """A misspelt --model, with the closest names timm has. The trainer asks first, before it scans the
    data or makes the checkpoints folder."""
    import timm  # slow to import: deferred so that input errors are reported at once

    from imagenet_elastic.checkpoint.published import WEIGHT_SOURCES

    tiny_models.register()
    if name.startswith(WEIGHT_SOURCES):  # the architecture is in the source's config.json: checked as it is read
        return
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models()"
        raise UserError(f"--model {name!r} is not a timm model{hint}")


def create_model(name: str, num_classes: int, drop_path: float = 0.0, blurpool: bool = False,
                 published: Optional[Published] = None, grad_checkpointing: bool = False,
                 sizes: Sizes = ()) -> nn.Module:
    """A timm model with random weights, or with `published` ones (--pretrained, already read: see
    checkpoint/published.py); `blurpool`: see blur_strided_convs; `grad_checkpointing`: see recompute_activations;
    `sizes`: the image sizes it must take (see input_options)."""
    import timm

    from imagenet_elastic.checkpoint import published as published_weights

    check_model_name(name)
    extra: dict = {"drop_path_rate": drop_path} if drop_path else {}
    extra.update(input_options(name, sizes))
    weights = published_weights.timm_options(published) if published is not None else {"pretrained": False}
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


Sizes = Sequence[tuple[int, str]]  # image sizes in pixels, each with the flag that asks for it


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
    crop = eval_sizes(saved_setting(settings, "image_size"), settings.get("val_crop_size"),
                      settings.get("val_resize"))[0]
    return ((crop, "the checkpoint's --val-crop-size"),)


def input_options(name: str, sizes: Sizes) -> dict[str, Any]:
    """timm's `img_size` and `dynamic_img_size` that make model `name` take images of every size in `sizes` (the
    first: the size its weights are made for), for a model timm builds for one input size (ViT, DeiT, Swin, MLP-Mixer
    ...: its pretrained_cfg says fixed_input_size), where that size is not the run's; {} where none is needed. With
    `img_size` timm sizes the position embeddings for it (and resamples published ones to it); `dynamic_img_size`
    resamples them at each forward, for a model that takes several sizes (a validation crop or a progressive
    resize other than the training size). Which of the two a model takes is asked of copies built on the meta
    device (no memory, no initialisation) and given an image of each size there. A model that takes none of them
    is a UserError naming it, its size and the flag, before anything is read: else its first step would end in a
    traceback."""
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
    if others:
        raise UserError(f"--model {name} takes one image size (timm builds it for {side} px, or for another): it "
                        f"can be made for {flag[built]} {built} but then not for {flag[others[-1]]} {others[-1]}; "
                        "train and validate at one size, or choose a model that takes any size")
    raise UserError(f"--model {name} takes {side} px images only: timm cannot build it for {flag[built]} {built}; "
                    f"pass {flag[built]} {native[0]}, or choose a model that takes any size")


def _pretrained_cfg(name: str) -> dict[str, Any]:
    """timm's pretrained_cfg of a model name (its default tag's where it names none); for `hf-hub:` and
    `local-dir:` names that of a copy built on the meta device from their config.json."""
    import timm

    from imagenet_elastic.checkpoint.published import WEIGHT_SOURCES

    if not name.startswith(WEIGHT_SOURCES):
        try:
            return timm.models.get_pretrained_cfg(name).to_dict()
        except (RuntimeError, AttributeError):  # a name timm knows without a pretrained_cfg
            pass
    with torch.device("meta"):
        return dict(getattr(timm.create_model(name, num_classes=1, pretrained=False), "pretrained_cfg", {}) or {})


def _takes(model: nn.Module, size: tuple[int, int]) -> bool:
    """Whether a model built on the meta device runs an image of `size` (height, width) pixels (in eval mode, as
    validation runs it; a shape check fails there as it would in a real step)."""
    try:
        with torch.device("meta"), torch.no_grad():
            model.eval()(torch.empty(1, 3, *size))
    except (AssertionError, RuntimeError, ValueError):
        return False
    return True


def check_model_options(name: str, drop_path: float, blurpool: bool, layer_decay: Optional[float],
                        grad_checkpointing: bool, distillation_head: bool = False) -> None:
    """--drop-path, --blurpool, --layer-decay, --grad-checkpointing and --kd-token-distill-type hard
    (`distillation_head`) ask for what a model may lack (stochastic depth, a strided convolution to blur, numbered
    layers, checkpointed blocks, DeiT's distillation head): asked of a copy built on the meta device (no memory, no
    initialisation) by the same code that builds the run's model, so that a refusal comes before the data is scanned
    and leaves nothing on disk."""
    from imagenet_elastic.optim.optimizer import check_layer_decay
    from imagenet_elastic.train.distillation import has_distillation_head

    if not (drop_path or blurpool or layer_decay is not None or grad_checkpointing or distillation_head):
        return
    with torch.device("meta"):
        model = create_model(name, 1, drop_path, blurpool, grad_checkpointing=grad_checkpointing)
    if layer_decay is not None:
        check_layer_decay(model, name)
    if distillation_head and not has_distillation_head(model):
        raise UserError(f"--kd-token-distill-type hard: timm's {name} has no distillation head (DeiT's "
                        "`*_distilled_*` models have one); a student without one learns the teacher's logits (KL)")


def recompute_activations(model: nn.Module, name: str) -> None:
    """--grad-checkpointing: timm's set_grad_checkpointing, where the model's blocks run under
    torch.utils.checkpoint, which recomputes them in the backward pass with the forward's random state (drop
    path draws the same). Batch norm would update its running statistics a second time as it recomputes:
    the training step runs the backward with them frozen (step.train_step)."""
    try:
        model.set_grad_checkpointing(True)
    except (AttributeError, NotImplementedError, AssertionError):
        raise UserError(f"--grad-checkpointing: timm's {name} does not support gradient checkpointing") from None
    if not getattr(model, "grad_checkpointing", True):
        raise UserError(f"--grad-checkpointing: timm's {name} does not support gradient checkpointing")


BLUR_MIN_CHANNELS = 16  # FFCV's rule: the stem's RGB convolution keeps its input as it is


def blur_strided_convs(model: nn.Module) -> list[str]:
    """FFCV's BlurPool (--blurpool): every convolution with a stride above 1 and at least 16 input channels
    sees its input blurred first by a 3x3 binomial filter (timm's BlurPool2d at stride 1, zero padding), so
    that downsampling does not alias. Returns the names of those convolutions.

    Each such convolution keeps its weights and becomes an instance of a subclass of its own class that
    blurs first; the filter is a buffer that is not saved. So the state dict stays the plain model's
    (checkpoints, --initial-checkpoint and exports keep timm's names, and a model timm rebuilds from them
    gets its blur back from this function), and torch.compile sees another class, not a forward hook, which
    dynamo does not guard on: it ran a blurred model with the graph of a plain one compiled before it
    (tests/test_blurpool.py).
    """
    from timm.layers import BlurPool2d

    names = []
    for name, conv in list(model.named_modules()):  # listed first: the loop adds modules
        if (isinstance(conv, nn.Conv2d) and not isinstance(conv, _BlurFirst) and max(conv.stride) > 1
                and conv.in_channels >= BLUR_MIN_CHANNELS):
            conv.blur = BlurPool2d(conv.in_channels, filt_size=3, stride=1, pad_mode="constant").to(
                device=conv.weight.device, dtype=conv.weight.dtype)
            conv.__class__ = _blurred_class(type(conv))
            names.append(name)
    return names


def blurred(model: nn.Module) -> int:
    """How many convolutions blur_strided_convs gave a blur."""
    return sum(isinstance(m, _BlurFirst) for m in model.modules())


class _BlurFirst:
    """Put before a convolution class among its bases: its forward blurs the input, then convolves."""

    blur: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.blur(x))  # type: ignore[misc]


@functools.cache
def _blurred_class(conv_class: type) -> type:
    return type(f"Blurred{conv_class.__name__}", (_BlurFirst, conv_class), {"__module__": __name__})


BlurredConv2d = _blurred_class(nn.Conv2d)  # found by name: a whole pickled model (torch.save(model)) loads again


@dataclass(frozen=True)
class Precision:
    """The autocast dtype of a run (None: fp32) and why it was chosen, for the start-up table."""

    dtype: Optional[torch.dtype]
    reason: str
    warning: Optional[str] = None  # said once at start: a precision asked for that this device emulates

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[self.dtype]

    def describe(self) -> str:
        return self.name + (" + GradScaler" if self.dtype == torch.float16 else "") + f" ({self.reason})"


def _cpu_probe(*names: str) -> bool:
    """True when any of torch.cpu's capability probes says yes; probes a torch version lacks say no."""
    return any(getattr(torch.cpu, name, lambda: False)() for name in names)


def native_low_precision(device: torch.device) -> dict[str, bool]:
    """Which of bf16 and fp16 this device computes natively rather than by emulation.

    On a CPU, bf16 needs AVX512-BF16 or AMX: without them oneDNN runs bf16 convolutions on a
    reference path many times slower than fp32 (pytorch/pytorch#111456). Note that
    `torch.ops.mkldnn._is_mkldnn_bf16_supported()` also says yes on plain AVX-512, where bf16 is
    slower than fp32 too. fp16 on a CPU needs AMX-FP16. On a GPU, bf16 needs compute capability 8.0
    (Ampere); `is_bf16_supported()` counts emulation as support unless told not to.
    """
    if device.type == "cuda":
        try:
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch before the argument existed counted native support only
            bf16 = torch.cuda.is_bf16_supported()
        return {"bf16": bf16, "fp16": True}
    return {"bf16": _cpu_probe("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
            "fp16": _cpu_probe("_is_amx_fp16_supported")}


def choose_precision(amp: str, device_type: str, native: Mapping[str, bool]) -> Precision:
    """--amp auto: the fastest correct precision. On a GPU bf16 where native, else fp16 with a
    GradScaler; on a CPU bf16 only where native, else fp32 (the emulated paths are far slower).
    An explicit choice is kept, with a warning when this device only emulates it."""
    where = "GPU" if device_type == "cuda" else "CPU"
    if amp == "auto":
        if native["bf16"]:
            return Precision(torch.bfloat16, f"auto: this {where} has native bf16")
        if device_type == "cuda":
            return Precision(torch.float16, "auto: this GPU has no native bf16")
        return Precision(None, "auto: this CPU has no native bf16")
    if amp == "none":
        return Precision(None, "--amp none")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    if native[amp]:
        return Precision(dtype, f"--amp {amp}")
    return Precision(dtype, f"--amp {amp}; emulated on this {where}",
                     warning=f"--amp {amp}: this {where} has no native {amp}, so it runs emulated, far slower "
                             f"than fp32 (see docs/BENCHMARKS.md); --amp auto picks the fastest precision "
                             "for this machine")


def resolve_precision(amp: str, device: torch.device) -> Precision:
    return choose_precision(amp, device.type, native_low_precision(device))


def place_model(model: nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    """The model as training runs it: on its device, in its memory layout."""
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def use_fastest_kernels(device: torch.device) -> None:
    """On CUDA, cuDNN times its algorithms at each new shape and keeps the fastest: worth it here, where a run's
    input shapes are fixed (a process-wide setting, so the build step that picks the device sets it)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def create_ema(model: nn.Module, decay: float, warmup: bool) -> nn.Module:
    """timm's ModelEmaV3: a copy of `model` (as it is now) that `update(model, step)` moves towards it."""
    from timm.utils import ModelEmaV3

    return ModelEmaV3(model, decay=decay, use_warmup=warmup)
