"""Parameter groups are timm's: no weight decay on what a model's no_weight_decay() names, --layer-decay's groups as
timm's create_optimizer_v2 builds them; an optimizer state saved under the old 1-D rule (or any other grouping)
finds its parameters by name, and continues bitwise."""

from __future__ import annotations

import io

import pytest
import torch
from makers import make_state, steps

from imagenet_elastic.errors import UserError
from imagenet_elastic.models.create import create_model
from imagenet_elastic.optim.optimizer import OPTIMIZERS, check_layer_decay, create_optimizer
from imagenet_elastic.train.state import TrainState

CPU = torch.device("cpu")


def groups_by_name(model: torch.nn.Module, groups: list[dict]) -> list[tuple[tuple[str, ...], float, float]]:
    """(parameter names, weight decay, LR scale) of each group, in order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(tuple(names[id(p)] for p in g["params"]), g["weight_decay"], g.get("lr_scale", 1.0)) for g in groups]


def test_a_vits_position_embedding_and_class_token_are_not_decayed():
    model = create_model("test_vit", num_classes=3)
    optimizer = create_optimizer(model, 0.1, 0.9, 0.05, CPU, "adamw")
    undecayed = {n for g in optimizer.param_groups if g["weight_decay"] == 0 for n in g["param_names"]}
    decayed = {n for g in optimizer.param_groups if g["weight_decay"] == 0.05 for n in g["param_names"]}
    assert {"pos_embed", "cls_token"} <= undecayed
    assert "patch_embed.proj.weight" in decayed and "head.weight" in decayed
    assert undecayed | decayed == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("model_name", ["test_vit", "test_resnet"])
@pytest.mark.parametrize("layer_decay", [None, 0.75])
def test_the_groups_are_those_timms_create_optimizer_v2_builds_from_the_model(model_name, layer_decay):
    from timm.optim import create_optimizer_v2

    model = create_model(model_name, num_classes=3)
    ours = create_optimizer(model, 0.1, 0.9, 0.05, CPU, "adamw", layer_decay=layer_decay)
    timms = create_optimizer_v2(model, opt="adamw", lr=0.1, weight_decay=0.05, layer_decay=layer_decay)
    assert groups_by_name(model, ours.param_groups) == groups_by_name(model, timms.param_groups)
    if layer_decay is not None:  # the head at the full LR, the layer below at 0.75 of it, ...
        scales = sorted({g["lr_scale"] for g in ours.param_groups}, reverse=True)
        assert len(scales) > 2 and scales[:3] == [1.0, 0.75, 0.75 ** 2]


def test_layer_decay_refuses_a_model_whose_layers_are_not_numbered():
    check_layer_decay(create_model("test_resnet", num_classes=3), "test_resnet")
    with pytest.raises(UserError, match="--layer-decay: timm's plain has no group_matcher"):
        check_layer_decay(torch.nn.Linear(3, 4), "plain")


def legacy_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    """The optimizer as the code before timm's groups built it: decayed parameters (2-D and more) first, the
    1-D ones second, no names (train/optimizer.py until November 2026)."""
    from timm.optim import create_optimizer_v2

    decay = [p for p in model.parameters() if p.ndim > 1]
    plain = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 1e-4}, {"params": plain, "weight_decay": 0.0}]
    maker, takes_momentum, _ = OPTIMIZERS[name]
    extra = {"momentum": 0.9} if takes_momentum else {}
    if maker == "torch":
        return torch.optim.SGD(groups, lr=0.1, **extra)
    return create_optimizer_v2(groups, opt=name, lr=0.1, weight_decay=1e-4, **extra)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_state_saved_under_the_old_1d_rule_continues_bitwise_under_timms_groups(name):
    straight = make_state(0, name)
    straight.optimizer = legacy_optimizer(straight.model, name)
    steps(straight, 0, 5)

    old = make_state(0, name)
    old.optimizer = legacy_optimizer(old.model, name)
    steps(old, 0, 3)
    buffer = io.BytesIO()
    torch.save(old.capture({}, {}), buffer)
    buffer.seek(0)
    resumed = make_state(0, name)  # today's optimizer: timm's groups, undecayed first, with names
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.0, 1e-4]
    resumed.apply(torch.load(buffer, weights_only=True))
    for param in resumed.model.parameters():  # each parameter got its own state back, not another's
        assert resumed.optimizer.state[param]  # a state for every parameter, at its own shape
        assert all(v.shape == param.shape for v in resumed.optimizer.state[param].values() if v.ndim)
    steps(resumed, 3, 2)
    for (key, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), key


def test_a_state_of_other_parameters_is_refused_not_mixed_up():
    vit = create_model("test_vit", num_classes=3)
    state = TrainState(vit, create_optimizer(vit, 0.1, 0.9, 1e-4, CPU), torch.amp.GradScaler("cpu", enabled=False))
    steps(state, 0, 1)
    saved = state.optimizer.state_dict()
    other = make_state(0)
    with pytest.raises(ValueError, match="other parameters than this model's"):
        other.optimizer.load_state_dict(saved)


def test_a_state_grouped_with_layer_decay_loads_by_name_into_plain_groups():
    """A ViT checkpoint of another grouping (here --layer-decay's, resumed without it): each parameter's moments
    follow it by name."""
    torch.manual_seed(0)
    model = create_model("test_vit", num_classes=3)
    state = TrainState(model, create_optimizer(model, 0.1, 0.9, 1e-4, CPU, "adamw", layer_decay=0.7),
                       torch.amp.GradScaler("cpu", enabled=False))
    steps(state, 0, 2)
    moments = {n: state.optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    plain = create_optimizer(model, 0.1, 0.9, 1e-4, CPU, "adamw")
    plain.load_state_dict(state.optimizer.state_dict())
    assert len(plain.param_groups) == 2
    for name, param in model.named_parameters():
        assert torch.equal(plain.state[param]["exp_avg"], moments[name]), name


@pytest.mark.parametrize("name", ["sgd", "lamb"])
def test_a_resume_with_other_settings_trains_with_them_and_keeps_what_training_wrote(name):
    """--weight-decay, --momentum and --layer-decay changed at a resume (the start warns of each change) are what the
    optimizer then uses, not the checkpoint's; each parameter's momentum or moments, and LAMB's step count (kept in
    its groups), come from the checkpoint."""
    torch.manual_seed(0)
    model = create_model("test_vit", num_classes=3)
    state = TrainState(model, create_optimizer(model, 0.1, 0.9, 1e-4, CPU, name, layer_decay=0.7),
                       torch.amp.GradScaler("cpu", enabled=False))
    steps(state, 0, 2)
    saved = state.optimizer.state_dict()
    written = {n: {k: v.clone() for k, v in state.optimizer.state[p].items()} for n, p in model.named_parameters()}
    resumed = create_optimizer(model, 0.1, 0.8, 0.05, CPU, name, layer_decay=0.5)
    asked = [{k: v for k, v in g.items() if k != "params"} for g in resumed.param_groups]
    resumed.load_state_dict(saved)
    settings = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in resumed.param_groups]
    assert settings == asked
    assert {g["weight_decay"] for g in resumed.param_groups} == {0.0, 0.05}
    assert [g.get("momentum") for g in resumed.param_groups] == [0.8 if name == "sgd" else None] * len(settings)
    if name == "lamb":  # a one-element tensor in each group
        assert [float(g["step"]) for g in resumed.param_groups] == [2.0] * len(settings)
    for n, p in model.named_parameters():
        assert resumed.state[p].keys() == written[n].keys(), n
        for key, value in written[n].items():
            assert torch.equal(resumed.state[p][key], value), (n, key)
