"""--opt: every optimizer gets the same parameter groups, and its state continues exactly from a checkpoint."""

from __future__ import annotations

import io

import pytest
import torch
from makers import make_state, steps

from imagenet_elastic.models.create import create_ema
from imagenet_elastic.optim.optimizer import OPTIMIZERS, create_optimizer
from imagenet_elastic.train.state import TrainState

EXPECTED = {"sgd": "SGD", "nesterov": "SGD", "adamw": "AdamW", "lamb": "Lamb", "lars": "Lars"}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_decays_weights_but_not_norms_and_biases(name):
    optimizer = make_state(0, name).optimizer
    assert type(optimizer).__name__ == EXPECTED[name]
    plain, decayed = optimizer.param_groups  # timm's order: the undecayed group first
    assert decayed["weight_decay"] == 1e-4 and plain["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decayed["params"]) and all(p.ndim <= 1 for p in plain["params"])
    assert optimizer.param_groups[0].get("nesterov", False) == (name == "nesterov")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_continues_bitwise_from_a_captured_state(name):
    straight = make_state(0, name)
    steps(straight, 0, 5)

    interrupted = make_state(0, name)
    steps(interrupted, 0, 3)
    buffer = io.BytesIO()
    torch.save(interrupted.capture({}, {}), buffer)
    buffer.seek(0)
    resumed = make_state(0, name)
    resumed.apply(torch.load(buffer, weights_only=True))
    steps(resumed, 3, 2)
    for (key, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), key
    untrained = make_state(0, name).model.state_dict()["fc.weight"]
    assert not torch.equal(straight.model.state_dict()["fc.weight"], untrained)


def with_ema(name: str, decay: float = 0.9, warmup: bool = False) -> TrainState:
    state = make_state(0, name)
    state.ema = create_ema(state.model, decay, warmup)
    return state


def ema_steps(state: TrainState, first: int, count: int) -> None:
    for step in range(first, first + count):
        steps(state, step, 1)
        state.ema.update(state.model, step=step + 1)


@pytest.mark.parametrize("warmup", [False, True])
def test_the_weight_average_is_captured_and_continues_bitwise(warmup):
    straight = with_ema("sgd", warmup=warmup)
    ema_steps(straight, 0, 6)

    interrupted = with_ema("sgd", warmup=warmup)
    ema_steps(interrupted, 0, 4)
    buffer = io.BytesIO()
    torch.save(interrupted.capture({}, {}), buffer)
    buffer.seek(0)
    resumed = with_ema("sgd", warmup=warmup)
    resumed.apply(torch.load(buffer, weights_only=True))
    ema_steps(resumed, 4, 2)
    for (key, a), b in zip(straight.ema.module.state_dict().items(), resumed.ema.module.state_dict().values()):
        assert torch.equal(a, b), key
    average, weights = straight.ema.module.state_dict()["fc.weight"], straight.model.state_dict()["fc.weight"]
    assert not torch.equal(average, weights)  # an average, not a copy
    assert not torch.equal(average, make_state(0, "sgd").model.state_dict()["fc.weight"])  # and it moved


def test_a_checkpoint_without_an_average_starts_it_from_its_weights():
    plain = make_state(0, "sgd")
    steps(plain, 0, 2)
    resumed = with_ema("sgd")
    resumed.apply(plain.capture({}, {}))
    for key, value in plain.model.state_dict().items():
        assert torch.equal(resumed.ema.module.state_dict()[key], value), key


def scaled_step(state: TrainState, scaler: torch.amp.GradScaler, grads: list[torch.Tensor]) -> None:
    """One GradScaler step with these (unscaled) gradients, as the backward of a scaled loss leaves them."""
    scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
    for param, grad in zip(state.model.parameters(), grads):
        param.grad = torch.empty_like(param).copy_(grad * scaler.get_scale())
    scaler.step(state.optimizer)
    scaler.update()


def test_fused_sgd_after_an_overflowed_first_step_holds_the_momentum_unfused_sgd_holds():
    """fp16's first step often overflows at GradScaler's initial scale: the fused kernel then returns before it
    writes the momentum torch made with empty_like, and the next step read 0.9 x garbage + g. CUDA's fused
    kernel and the CPU's behave alike here, so the CPU proves it."""
    runs = {}
    for fused in (True, False):
        state = make_state(0)
        state.optimizer = create_optimizer(state.model, 0.1, 0.9, 1e-4, torch.device("cpu"), fused=fused)
        assert bool(state.optimizer.param_groups[0]["fused"]) == fused
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        before = [p.detach().clone() for p in state.model.parameters()]
        scaled_step(state, scaler, [torch.full(p.shape, float("inf")) for p in state.model.parameters()])
        assert scaler.get_scale() == 2.0 ** 15  # the step was skipped
        assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))
        generator = torch.Generator().manual_seed(3)
        scaled_step(state, scaler, [torch.randn(p.shape, generator=generator) for p in state.model.parameters()])
        runs[fused] = state
    for param, twin in zip(runs[True].model.parameters(), runs[False].model.parameters()):
        fused_momentum = runs[True].optimizer.state[param]["momentum_buffer"]
        torch.testing.assert_close(fused_momentum, runs[False].optimizer.state[twin]["momentum_buffer"])
        torch.testing.assert_close(param, twin)


def test_a_fused_sgd_loaded_from_a_state_without_momentum_still_starts_from_zeros():
    """A checkpoint of an unfused run before its first step (or after only skipped ones) holds no momentum."""
    unfused = make_state(0)
    assert not unfused.optimizer.state_dict()["state"]
    resumed = make_state(1)
    resumed.optimizer = create_optimizer(resumed.model, 0.1, 0.9, 1e-4, torch.device("cpu"), fused=True)
    resumed.apply(unfused.capture({}, {}))
    assert [g["fused"] for g in resumed.optimizer.param_groups] == [True, True]  # its own kernel, not the file's
    for param in resumed.model.parameters():
        momentum = resumed.optimizer.state[param]["momentum_buffer"]
        assert momentum.stride() == param.stride() and not momentum.any()
