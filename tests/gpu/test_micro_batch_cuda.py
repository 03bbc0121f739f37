"""--micro-batch auto on a real GPU: the probe meets the allocator's own out-of-memory errors, finds a size that
fits and leaves the model, the optimizer and the device's memory as they were; a step the allocator refuses is
redone in halves; and the step of --micro-batch auto (regrouping, the copy of the buffers) never makes the host
wait for the GPU. tests/train/test_micro_batch.py tests the logic on the CPU. Marked `cuda`, skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from imagenet_elastic.data.model_input import ModelInput
from imagenet_elastic.data.pipeline import Batch
from imagenet_elastic.data.sampler import BatchPlan
from imagenet_elastic.models.create import create_model
from imagenet_elastic.optim.optimizer import create_optimizer
from imagenet_elastic.train import memory_probe
from imagenet_elastic.train.micro_batch import MicroBatches
from imagenet_elastic.train.mixing import Mixer
from imagenet_elastic.train.step import StepContext, TrainLoss

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
GPU = torch.device("cuda", 0)


def model_and_optimizer():
    torch.manual_seed(0)
    model = create_model("test_resnet", 10).to(GPU, memory_format=torch.channels_last)
    return model, create_optimizer(model, 0.1, 0.9, 1e-4, GPU)


def test_the_probe_meets_the_allocators_refusals_and_leaves_the_device_as_it_was():
    model, optimizer = model_and_optimizer()
    to = ModelInput(GPU, torch.bfloat16, True)
    # cuBLAS keeps a workspace per thread and stream in torch's allocator (32 MiB each on Hopper), made by the first
    # matrix product of the forward's thread and of autograd's: a two-image trial makes them before the count
    assert memory_probe.probe(model, optimizer, TrainLoss(0.1), to, 224, 2, lambda size: None) == 2
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # fused SGD's momentum exists (as zeros) before its first step: optimizer.zero_momentum
    momentum = {p: {k: v.clone() for k, v in entries.items()} for p, entries in optimizer.state.items()}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated(GPU)
    tried = []

    def halving(size: int):
        tried.append(size)
        return size // 2 or None
    total = torch.cuda.get_device_properties(GPU).total_memory
    first = 1 << max(12, (total // (224 * 224 * 3)).bit_length())  # more uint8 images than the device holds
    found = memory_probe.probe(model, optimizer, TrainLoss(0.1), to, 224, first, halving)
    assert found is not None and found < first and tried, "the allocator never refused"
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert optimizer.state.keys() == momentum.keys() and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, momentum[p][k]) for p, entries in optimizer.state.items() for k, v in entries.items())
    assert torch.cuda.memory_allocated(GPU) <= allocated + 64 * 2**20, "the probe left tensors on the device"


def batches(steps: int, size: int) -> list[Batch]:
    """On the device already, as feed.device_batches hands them to the step."""
    g = torch.Generator().manual_seed(7)
    return [Batch(torch.randint(0, 256, (size, 32, 32, 3), dtype=torch.uint8, generator=g).to(GPU),
                  torch.randint(0, 10, (size,), generator=g).to(GPU), torch.arange(size)) for _ in range(steps)]


def test_an_auto_step_never_synchronizes_the_host_and_redoes_a_refused_one_in_halves():
    model, optimizer = model_and_optimizer()
    ctx = StepContext(model, optimizer, torch.amp.GradScaler("cuda", enabled=False), TrainLoss(0.1),
                      ModelInput(GPU, torch.bfloat16, channels_last=True), mixer=Mixer(0.2, 1.0, 10))
    warnings = []
    micro = MicroBatches(BatchPlan(16, 1, 16), 8, 0, auto=True, mixes=True, warn=warnings.append)
    for step, batch in enumerate(batches(2, 16)):  # warm-up: cuDNN's choices, the allocator
        micro.step(ctx, [batch], 0.1, 0, step)
    measured = batches(3, 16)  # made before: their copies from pageable memory are the test's, not the step's
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, batch in enumerate(measured, start=2):
            micro.step(ctx, [batch], 0.1, 0, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    def refuse(module, args):  # the allocator's own error, for micro-batches of more than 4
        if args[0].shape[0] > 4:
            torch.empty(1 << 50, dtype=torch.uint8, device=GPU)
    hook = model.get_classifier().register_forward_pre_hook(refuse)
    try:
        micro.step(ctx, batches(1, 16), 0.1, 0, 5)
    finally:
        hook.remove()
    assert micro.size == 4 and len(warnings) == 1 and "CUDA out of memory" in warnings[0]
