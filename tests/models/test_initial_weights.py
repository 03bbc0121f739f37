"""--initial-checkpoint: weights from our checkpoints, timm/torchvision state dicts and safetensors files."""

from __future__ import annotations

import pytest
import timm
import torch
from conftest import assert_names
from safetensors.torch import save_file

from imagenet_elastic.errors import UserError
from imagenet_elastic.models.create import create_model
from imagenet_elastic.models.weights import InitialWeights


def source_model(classes: int = 10) -> torch.nn.Module:
    torch.manual_seed(5)
    return timm.create_model("test_resnet", num_classes=classes)


def fresh(classes: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("test_resnet", classes)


def assert_loaded_except_the_head(model: torch.nn.Module, source: torch.nn.Module, head_refit: bool) -> None:
    before = fresh(model.get_classifier().out_features).state_dict()
    for key, value in source.state_dict().items():
        if key.startswith("fc."):
            expected = before[key] if head_refit else value
            assert torch.equal(model.state_dict()[key], expected), key
        else:
            assert torch.equal(model.state_dict()[key], value), key


def test_a_timm_state_dict_of_another_class_count_loads_all_but_the_classifier(tmp_path):
    source = source_model(10)
    torch.save(source.state_dict(), tmp_path / "timm.pth")
    model = fresh(4)
    said = InitialWeights.read(str(tmp_path / "timm.pth")).load(model, "timm.pth", "test_resnet")
    assert said == "timm.pth (classifier re-initialised: 10 classes there, 4 here)"
    assert_loaded_except_the_head(model, source, head_refit=True)


def test_our_checkpoint_with_ddp_and_compile_prefixes_loads_everything(tmp_path):
    source = source_model(4)
    prefixed = {f"module._orig_mod.{k}": v for k, v in source.state_dict().items()}
    torch.save({"model": prefixed, "epoch": 3, "config": {"lr": 0.1}}, tmp_path / "last.pt")
    model = fresh(4)
    said = InitialWeights.read(str(tmp_path / "last.pt")).load(model, "last.pt", "test_resnet")
    assert said == "last.pt"
    assert_loaded_except_the_head(model, source, head_refit=False)


def test_reading_tells_whether_a_checkpoint_of_ours_was_trained_with_blurpool(tmp_path):
    state = source_model(4).state_dict()
    for name, saved in (("blurred.pt", {"blurpool": True}), ("plain.pt", {"blurpool": False}), ("old.pt", {})):
        torch.save({"model": state, "model_name": "test_resnet", "config": saved}, tmp_path / name)
    torch.save(state, tmp_path / "timm.pth")
    assert [InitialWeights.read(str(tmp_path / name)).blurpool for name in ("blurred.pt", "plain.pt", "old.pt",
                                                                            "timm.pth")] == [True, False, False, None]


def test_a_safetensors_file_loads(tmp_path):
    source = source_model(7)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "w.safetensors"))
    model = fresh(4)
    InitialWeights.read(str(tmp_path / "w.safetensors")).load(model, "w", "test_resnet")
    assert_loaded_except_the_head(model, source, head_refit=True)


def test_weights_of_another_model_are_refused_naming_the_file_and_the_model(tmp_path):
    torch.save(timm.create_model("resnet18", num_classes=4).state_dict(), tmp_path / "r18.pth")
    weights = InitialWeights.read(str(tmp_path / "r18.pth"))
    with pytest.raises(UserError) as caught:
        weights.load(fresh(4), "r18.pth", "test_resnet")
    assert_names(str(caught.value), "--initial-checkpoint r18.pth", "--model test_resnet")


@pytest.mark.parametrize(("content", "message"), [
    (b"not a checkpoint at all", "is not a checkpoint or state dict"),
    (b"these are not weights" * 20, "is not a checkpoint or state dict"),  # an IndexError inside torch.load
    (None, "holds no state dict of tensors"),
])
def test_a_file_that_is_not_a_checkpoint_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "weights.pth"
    if content is None:
        torch.save({"epochs": 3, "note": "no tensors here"}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(UserError, match=f"--initial-checkpoint {path} {message}"):
        InitialWeights.read(str(path))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        InitialWeights.read(str(tmp_path / "absent.pth"))



def test_a_foreign_pt_without_a_model_name_asked_for_its_average_is_one_line_not_a_key_error(tmp_path):
    """load_weights (--teacher, evaluate MODEL --ema) on a .pt with weights but no model name: what it lacks for
    --ema is said before anything reads the name."""
    from imagenet_elastic.models.weights import load_weights

    path = tmp_path / "foreign.pt"
    torch.save({"model": {}, "epoch": 0, "classes": ["a"]}, path)
    with pytest.raises(UserError) as caught:
        load_weights(str(path), "MODEL", ema=True)
    assert str(caught.value) == (f"checkpoint {path} has no weight average (it was trained without --model-ema): use "
                                 "it without --ema")
