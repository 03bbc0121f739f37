"""--amp auto picks the fastest correct precision on every machine: both CPU branches proven on any CPU."""

from __future__ import annotations

import re

import inprocess
import pytest
import torch
from conftest import SMALL_RUN

from imagenet_elastic.models.device import choose_precision, native_low_precision

NATIVE = {"bf16": True, "fp16": True}
NO_BF16 = {"bf16": False, "fp16": False}


def test_auto_on_a_cpu_with_native_bf16_trains_in_bf16():
    precision = choose_precision("auto", "cpu", {"bf16": True, "fp16": False})
    assert precision.dtype == torch.bfloat16 and precision.warning is None
    assert precision.describe() == "bf16 (auto: this CPU has native bf16)"


def test_auto_on_a_cpu_without_native_bf16_trains_in_fp32_and_says_why():
    precision = choose_precision("auto", "cpu", NO_BF16)
    assert precision.dtype is None and precision.warning is None
    assert precision.describe() == "fp32 (auto: this CPU has no native bf16)"


def test_auto_on_a_gpu_keeps_bf16_where_native_else_fp16_with_a_grad_scaler():
    assert choose_precision("auto", "cuda", NATIVE).dtype == torch.bfloat16
    fp16 = choose_precision("auto", "cuda", {"bf16": False, "fp16": True})
    assert fp16.dtype == torch.float16 and fp16.describe() == "fp16 + GradScaler (auto: this GPU has no native bf16)"


def test_bf16_asked_for_on_a_cpu_without_it_still_runs_with_one_warning_that_says_how_to_avoid_it():
    precision = choose_precision("bf16", "cpu", NO_BF16)
    assert precision.dtype == torch.bfloat16
    assert "emulated" in precision.reason
    assert "no native bf16" in precision.warning and "emulated" in precision.warning
    assert "--amp auto" in precision.warning


def test_a_precision_the_device_has_is_taken_as_asked_without_a_warning():
    assert choose_precision("bf16", "cpu", NATIVE).warning is None
    assert choose_precision("fp16", "cuda", NO_BF16 | {"fp16": True}).warning is None
    none = choose_precision("none", "cpu", NATIVE)
    assert none.dtype is None and none.describe() == "fp32 (--amp none)"


def test_fp16_on_a_cpu_without_amx_fp16_warns_too():
    precision = choose_precision("fp16", "cpu", {"bf16": True, "fp16": False})
    assert precision.dtype == torch.float16 and "no native fp16" in precision.warning


@pytest.mark.parametrize(("avx512_bf16", "amx", "expected"),
                         [(True, False, True), (False, True, True), (False, False, False)])
def test_cpu_bf16_is_native_with_avx512_bf16_or_amx(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert native_low_precision(torch.device("cpu"))["bf16"] is expected


def test_a_torch_without_the_cpu_probes_counts_as_no_native_bf16(monkeypatch):
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert native_low_precision(torch.device("cpu")) == {"bf16": False, "fp16": False}


def test_plain_avx512_without_bf16_is_not_native_whatever_onednn_says(monkeypatch):
    """mkldnn's own check says yes on AVX-512 CPUs that only emulate bf16: it must not be consulted."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert choose_precision("auto", "cpu", native_low_precision(torch.device("cpu"))).dtype is None


def test_gpu_bf16_counts_only_native_support(monkeypatch):
    """torch's is_bf16_supported() says yes on pre-Ampere GPUs by counting emulation; we ask without it."""
    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return including_emulation  # a V100 or T4: emulated only

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert native_low_precision(torch.device("cuda")) == {"bf16": False, "fp16": True}
    assert asked == [False]


def test_gpu_bf16_on_a_torch_whose_check_takes_no_argument(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert native_low_precision(torch.device("cuda"))["bf16"] is True



def test_an_explicit_bf16_warns_once_where_this_cpu_only_emulates_it(image_folder, tmp_path):
    """The real trainer on this machine's CPU, whichever kind it is."""
    native = native_low_precision(torch.device("cpu"))["bf16"]
    result = inprocess.command([str(image_folder), *SMALL_RUN, "--workers", "0", "--epochs", "1",
                                "--max-steps-per-epoch", "1", "--amp", "bf16", "--checkpoints-path", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ([] if native else [f"warning: {choose_precision('bf16', 'cpu', NO_BF16).warning}"])
    reason = "--amp bf16" if native else "--amp bf16; emulated on this CPU"
    assert re.search(rf"precision\s+bf16 \({re.escape(reason)}\)$", result.stdout, re.MULTILINE), result.stdout
