"""The CUDA paths on a real GPU: NCCL, nvJPEG against the CPU decoder, AMP steps, the pinned host copy of
a background checkpoint. The rest of the suite tests their logic on the CPU; these run the kernels.

Marked `cuda` and skipped where no CUDA device is visible (CI has none). On a GPU machine:
`python3 -m pytest -q -m cuda tests/test_cuda.py` (scripts/gpu_checks.sh runs it as its `tests` part).
"""

from __future__ import annotations

import json
import os
import subprocess

import fault_injection as fi
import pytest
import torch
from conftest import REPO, SMALL_RUN, load_checkpoint, torchrun_cmd
from test_data import write_jpeg

from imagenet_elastic import data, gpu_decode
from imagenet_elastic.augment import POLICIES, Augment
from imagenet_elastic.checkpointer import HostCopy
from imagenet_elastic.engine import StepContext, train_step
from imagenet_elastic.file_index import scan_image_folder
from imagenet_elastic.loss import TrainLoss
from imagenet_elastic.model import create_model, create_optimizer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
GPU = torch.device("cuda", 0)


@pytest.fixture
def jpegs(tmp_path):
    """Twelve noisy JPEGs from 120 to 340 pixels wide: crops at 120 px never take DCT scaling on the CPU path."""
    for i in range(12):
        write_jpeg(str(tmp_path / "train" / f"c{i % 3}" / f"{i}.jpg"), 120 + 20 * i, 340 - 15 * i, seed=i)
    return scan_image_folder(str(tmp_path / "train"), "train")


def decode_on_gpu(index, augment: Augment, keys: list) -> torch.Tensor:
    dataset = data.TrainDataset(index, 120, 4, gpu_decode.encode_region, augment)
    batch = gpu_decode.collate([dataset[key] for key in keys])
    images = gpu_decode.BatchDecoder(GPU, print, augment)(batch)[0]
    assert images.device == GPU and images.dtype == torch.uint8 and images.shape == (len(keys), 120, 120, 3)
    return images.cpu()


def level_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).abs().mean(dim=(1, 2, 3))


def test_nvjpeg_batches_are_the_cpu_paths_crops_within_a_level_or_two(jpegs):
    keys = [(e, i) for e in range(2) for i in range(len(jpegs))]
    gpu = decode_on_gpu(jpegs, Augment(), keys)
    cpu = torch.stack([data.TrainDataset(jpegs, 120, 4)[key][0] for key in keys])
    difference = level_difference(gpu, cpu)
    assert difference.max() < 2, difference  # IDCT and float resize rounding; another crop differs by ~60


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_the_policy_and_erasing_on_the_gpu_draw_what_the_workers_draw(jpegs, policy):
    augment = Augment(policy=policy, erase=0.5)
    keys = [(e, i) for e in range(3) for i in range(len(jpegs))]
    gpu = decode_on_gpu(jpegs, augment, keys)
    cpu = torch.stack([data.TrainDataset(jpegs, 120, 4, augment=augment)[key][0] for key in keys])
    other = torch.stack([data.TrainDataset(jpegs, 120, 5, augment=augment)[key][0] for key in keys])
    same = level_difference(gpu, cpu)
    assert same.max() < 4, same
    assert level_difference(gpu, other).mean() > 4 * same.mean() + 1


@pytest.mark.parametrize("blurpool", [False, True], ids=["plain", "blurpool"])  # the FFCV recipes' depthwise blur
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_an_amp_step_on_the_gpu_trains(amp, blurpool):
    model = create_model("test_resnet", 10, blurpool=blurpool).to(GPU, memory_format=torch.channels_last)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = create_optimizer(model, 0.1, 0.9, 1e-4, GPU)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    ctx = StepContext(model, optimizer, scaler, TrainLoss(0.1), GPU, amp, channels_last=True)
    images = torch.randint(0, 256, (16, 32, 32, 3), dtype=torch.uint8, device=GPU)
    labels = torch.randint(0, 10, (16,), device=GPU)
    losses = [float(train_step(ctx, [(images, labels, None)], [slice(0, 16)], 16, 0.1, seed=0, step=s))
              for s in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_pinned_host_copy_of_a_checkpoint_holds_the_values_at_the_copy():
    state = {"model": {"w": torch.randn(1000, 1000, device=GPU)}, "list": [torch.arange(7, device=GPU)], "n": 3}
    expected = state["model"]["w"].cpu().clone()
    host = HostCopy(pin=True)
    copied = host.copy(state)
    state["model"]["w"].add_(1)  # training goes on at once
    assert copied["model"]["w"].is_pinned() and torch.equal(copied["model"]["w"], expected)
    assert torch.equal(copied["list"][0], torch.arange(7)) and copied["n"] == 3
    again = host.copy(state)
    assert again["model"]["w"].data_ptr() == copied["model"]["w"].data_ptr()  # the buffers are reused
    assert torch.equal(again["model"]["w"], expected + 1)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_nccl_rank_trains_with_decode_gpu_and_a_background_checkpoint(image_folder, tmp_path):
    env = fi.clean_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    cmd = torchrun_cmd(1, str(image_folder), *SMALL_RUN, "--device", "cuda", "--amp", "auto", "--decode", "gpu",
                       "--epochs", "1", "--checkpoints-path", str(tmp_path / "ckpt"))
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "batched on cuda" in result.stdout and "nccl" in result.stdout, result.stdout
    row = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["val_samples"] == 35 and 0 <= row["val_top1"] <= 100
    weights = load_checkpoint(tmp_path / "ckpt" / "last.pt")["model"]
    assert all(t.device.type == "cpu" and torch.isfinite(t.float()).all() for t in weights.values())
