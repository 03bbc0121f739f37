"""The model on its device: placed there in its memory layout (`place_model`), cuDNN's autotuning
(`use_fastest_kernels`), and a run's autocast precision (--amp), chosen from what this device computes natively."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


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
    """Which of bf16 and fp16 this device computes natively rather than by emulation. On a CPU, bf16 needs
    AVX512-BF16 or AMX: without them oneDNN runs bf16 convolutions on a reference path many times slower than fp32
    (pytorch/pytorch#111456); `torch.ops.mkldnn._is_mkldnn_bf16_supported()` also says yes on plain AVX-512, where
    bf16 is slower than fp32 too. fp16 on a CPU needs AMX-FP16. On a GPU bf16 needs compute capability 8.0;
    `is_bf16_supported()` counts emulation unless told not to."""
    if device.type == "cuda":
        try:
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch before the argument existed counted native support only
            bf16 = torch.cuda.is_bf16_supported()
        return {"bf16": bf16, "fp16": True}
    return {"bf16": _cpu_probe("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
            "fp16": _cpu_probe("_is_amx_fp16_supported")}


def choose_precision(amp: str, device_type: str, native: Mapping[str, bool]) -> Precision:
    """--amp auto: on a GPU bf16 where native, else fp16 with a GradScaler; on a CPU bf16 where native, else fp32
    (emulation is far slower). An explicit choice is kept, with a warning where it is emulated."""
    where = "GPU" if device_type == "cuda" else "CPU"
    if amp == "auto":
        if native["bf16"]:
            return Precision(torch.bfloat16, f"auto: this {where} has native bf16")
        return Precision(torch.float16 if device_type == "cuda" else None, f"auto: this {where} has no native bf16")
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
    return model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)


def use_fastest_kernels(device: torch.device) -> None:
    """On CUDA, cuDNN autotuning: worth it as input shapes are fixed; process-wide, set where the device is picked."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
