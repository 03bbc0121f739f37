"""A resumed run's optimizer state and weight average have their parameters' layout on every rank, whichever
path brought them: load-once (rank 0's tensors sent to the others), a direct load, a checkpoint of the other
--channels-last setting. CUDA's fused SGD refuses momentum of other strides than its parameter at the first step
(every rank but 0 crashed at every multi-GPU restart); the CPU kernels accept it, so these tests compare layouts.
"""

from __future__ import annotations

import io
import json
import subprocess

import pytest
import torch
from conftest import REPO, child_env, several_at_once
from state_probe import layout_mismatches

from imagenet_elastic.checkpoint import share
from imagenet_elastic.models.create import create_ema, create_model
from imagenet_elastic.optim.optimizer import OPTIMIZERS, create_optimizer
from imagenet_elastic.train.state import TrainState


def make_state(name: str, channels_last: bool, ema: bool = True) -> TrainState:
    torch.manual_seed(0)
    model = create_model("test_resnet", 3)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = create_optimizer(model, 0.1, 0.9, 1e-4, torch.device("cpu"), name)
    average = create_ema(model, 0.9, False) if ema else None
    return TrainState(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), ema=average)


def steps(state: TrainState, count: int) -> None:
    """Made-up gradients in their parameter's layout, as autograd makes them (no forward pass: fast)."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(count):
        for param in state.model.parameters():
            param.grad = torch.empty_like(param).copy_(torch.randn(param.shape, generator=generator))
        state.optimizer.step()


def saved(state: TrainState) -> dict:
    buffer = io.BytesIO()
    torch.save(state.capture({}, {}), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def sent_by_rank_0(snapshot: dict) -> dict:
    """What the other ranks receive through load-once (checkpoint/share.py), without the process group."""
    skeleton, buffer = share.pack(snapshot)
    return share.unpack(skeleton, buffer.clone())


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("path", ["direct", "load_once"])
@pytest.mark.parametrize(("saved_channels_last", "resumed_channels_last"), [(True, True), (False, True), (True, False)])
def test_resumed_optimizer_state_and_average_have_their_parameters_layout(
        name, path, saved_channels_last, resumed_channels_last):
    trained = make_state(name, saved_channels_last)
    steps(trained, 2)  # every optimizer's state exists after a step
    snapshot = saved(trained)
    if path == "load_once":
        snapshot = sent_by_rank_0(snapshot)
    resumed = make_state(name, resumed_channels_last)
    resumed.apply(snapshot)
    checked, wrong = layout_mismatches(resumed.model, resumed.optimizer, resumed.ema.module)
    assert checked >= 2 * len(list(resumed.model.parameters())) and not wrong, wrong
    convs = [p for p in resumed.model.parameters() if p.ndim == 4 and p.shape[-1] > 1]  # 1x1 kernels: both layouts
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) == resumed_channels_last for p in convs)
    for (key, value), original in zip(resumed.optimizer.state_dict()["state"].items(),
                                      trained.optimizer.state_dict()["state"].values()):
        for field, tensor in value.items():  # the same numbers, in the parameter's layout
            assert torch.equal(tensor, original[field]), (key, field)


def test_load_once_gives_back_channels_last_and_transposed_strides():
    weight = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    tree = {"w": weight, "t": torch.randn(6, 5).t(), "plain": torch.randn(2, 3), "view": torch.randn(4, 4)[:, :2]}
    received = sent_by_rank_0(tree)
    for key in ("w", "t", "plain"):
        assert received[key].stride() == tree[key].stride() and torch.equal(received[key], tree[key]), key
    assert received["view"].is_contiguous() and torch.equal(received["view"], tree["view"])  # not dense: packed


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_rank_torchrun_resume_gives_every_rank_state_in_its_parameters_layout(image_folder, tmp_path,
                                                                                     warm_python):
    """Real torchrun, real load-once (rank 1 receives rank 0's checkpoint over gloo), channels_last (the default),
    SGD's momentum and the average checked on both ranks just before the first resumed step. It is
    scripts/gpu_checks.sh's `restart` part, run here on the CPU with a tiny model (its processes forks of the warm
    python): on a GPU the same part puts both ranks on the device and steps with CUDA's fused SGD."""
    several_at_once()
    result = subprocess.run(["bash", "scripts/gpu_checks.sh", "restart", str(image_folder), str(tmp_path)], cwd=REPO,
                            env=child_env(PYTHON=warm_python, MODEL="test_resnet", BATCH="16", SIZE="32",
                                          BATCHES="2"), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [json.loads(text) for text in result.stdout.splitlines()]  # stdout: one JSON line for BENCHMARKS.md
    assert line["step"] == 2 * 2  # two epochs of BATCHES steps: the second one resumed
    assert [r["rank"] for r in line["ranks"]] == [0, 1]
    for report in line["ranks"]:
        assert report["resumed"] and report["checked"] > 0 and report["device"] == "cpu", report
        assert report["mismatches"] == [], report
