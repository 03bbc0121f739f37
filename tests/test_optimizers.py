"""--opt: every optimizer gets the same parameter groups, and its state continues exactly from a checkpoint."""

from __future__ import annotations

import io

import pytest
import torch
from test_state import make_state

from imagenet_elastic.config import OPTIMIZERS
from imagenet_elastic.model import create_ema
from imagenet_elastic.state import TrainState

EXPECTED = {"sgd": "SGD", "nesterov": "SGD", "adamw": "AdamW", "lamb": "Lamb", "lars": "Lars"}


def steps(state: TrainState, first: int, count: int) -> None:
    """Made-up gradients, a function of the step number (no forward pass: keeps the test fast)."""
    for step in range(first, first + count):
        generator = torch.Generator().manual_seed(step)
        for param in state.model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        state.optimizer.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_decays_weights_but_not_norms_and_biases(name):
    optimizer = make_state(0, name).optimizer
    assert type(optimizer).__name__ == EXPECTED[name]
    decayed, plain = optimizer.param_groups
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
