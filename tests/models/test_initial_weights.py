"""--initial-checkpoint: weights from our checkpoints, timm/torchvision state dicts and safetensors files."""

from __future__ import annotations

import argparse
import os
import zipfile

import pytest
import timm
import torch
from conftest import assert_names
from safetensors.torch import save_file

from imagenet_elastic.checkpoint import store
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


def test_our_checkpoint_of_other_class_names_gives_all_but_its_classifier(tmp_path):
    source = source_model(4)
    saved = ("ant", "bee", "cat", "dog")
    torch.save({"model": source.state_dict(), "model_name": "test_resnet", "classes": list(saved)}, tmp_path / "b.pt")
    weights = InitialWeights.read(str(tmp_path / "b.pt"))
    same = fresh(4)
    assert weights.load(same, "b.pt", "test_resnet", saved) == "b.pt"
    assert_loaded_except_the_head(same, source, head_refit=False)
    renamed = fresh(4)
    said = weights.load(renamed, "b.pt", "test_resnet", ("ant", "bee", "cat", "eel"))
    assert_names(said, "re-initialised", "'dog'", "'eel'")
    assert_loaded_except_the_head(renamed, source, head_refit=True)


def test_numbered_classes_are_unnamed_and_keep_the_classifier(tmp_path):
    source = source_model(4)
    torch.save({"model": source.state_dict(), "model_name": "test_resnet", "classes": ["n01", "n02", "n03", "n04"]},
               tmp_path / "b.pt")
    model = fresh(4)  # trained on the same images, read from shards without class names
    said = InitialWeights.read(str(tmp_path / "b.pt")).load(model, "b.pt", "test_resnet", ("0", "1", "2", "3"))
    assert said == "b.pt"
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


def foreign_zip(path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "no weights")


@pytest.mark.parametrize("damage", [
    lambda path: path.write_text("hello"),
    lambda path: path.write_bytes(b""),
    lambda path: path.write_bytes(b"these are not weights" * 20),  # torch: IndexError "pop from empty list"
    lambda path: (torch.save(source_model(4).state_dict(), path), os.truncate(path, 3000)),
    foreign_zip,
], ids=["text", "empty", "words", "cut_short", "foreign_zip"])
def test_a_damaged_file_is_said_in_the_words_a_damaged_checkpoint_is(tmp_path, damage):
    """What checkpoint/store.py says of the file from its zip directory, not torch's "101", "pop from empty list"
    or "(EOFError)"."""
    path = tmp_path / "weights.pth"
    damage(path)
    with pytest.raises(UserError) as caught:
        InitialWeights.read(str(path))
    why = store.damage(str(path))
    assert why is not None
    assert_names(str(caught.value), f"--initial-checkpoint {path}", why)


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


def our_checkpoint(path) -> dict:
    snapshot = {"model": fresh(3).state_dict(), "model_ema": None, "epoch": 1, "step": 2, "model_name": "test_resnet",
                "classes": ["a", "b", "c"], "config": {"image_size": 32}}
    torch.save(snapshot, path)
    return snapshot


@pytest.mark.parametrize("damage, culprit", [
    (lambda folder: (folder / "config.json").write_text("{"), "config.json"),
    (lambda folder: (folder / "config.json").write_text("[]"), "config.json"),
    (lambda folder: os.truncate(folder / "model.safetensors", 100), "model.safetensors"),
    (lambda folder: os.truncate(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size - 100),
     "model.safetensors"),
], ids=["config_cut", "config_not_an_object", "weights_cut_in_the_header", "weights_cut_at_the_end"])
@pytest.mark.parametrize("flag", ["MODEL", "--teacher"])
def test_a_damaged_export_folder_is_one_line_naming_the_damaged_file(tmp_path, damage, culprit, flag):
    """evaluate MODEL and --teacher read an export alike (load_weights)."""
    from imagenet_elastic.models import teacher_weights
    from imagenet_elastic.models.weights import load_weights
    from imagenet_elastic.tools.export import export

    our_checkpoint(tmp_path / "best.pt")
    export(str(tmp_path / "best.pt"), str(tmp_path / "export"), ema=False)
    damage(tmp_path / "export")
    with pytest.raises(UserError) as caught:
        teacher_weights.read(str(tmp_path / "export")) if flag == "--teacher" else load_weights(
            str(tmp_path / "export"), flag)
    assert_names(str(caught.value), flag, tmp_path / "export" / culprit)


@pytest.mark.parametrize("edit, culprit", [
    (lambda s: s.update(model=source_model(3).state_dict() | {"extra.weight": torch.zeros(1)}), "extra.weight"),
    (lambda s: s["model"].update({"fc.bias": torch.zeros(7)}), "fc.bias"),
    (lambda s: s.update(model=[1, 2]), "'model'"),
    (lambda s: s.pop("classes"), "classes"),
    (lambda s: s.update(classes=3), "classes"),
    (lambda s: s.pop("model_name"), "model_name"),
    (lambda s: s.update(model_name="no_such_net"), "'no_such_net'"),
], ids=["unexpected_key", "other_shape", "not_a_state_dict", "no_classes", "classes_not_a_list", "no_model_name",
        "unknown_model"])
def test_a_hand_edited_checkpoint_read_whole_is_one_line_naming_it_and_what_is_wrong(tmp_path, edit, culprit):
    """load_weights (evaluate MODEL, --teacher) and saved_model (export, --evaluate): not torch's RuntimeError, nor a
    KeyError, nor `--model` the user never gave."""
    from imagenet_elastic.models.weights import load_weights

    snapshot = our_checkpoint(tmp_path / "edited.pt")
    edit(snapshot)
    torch.save(snapshot, tmp_path / "edited.pt")
    with pytest.raises(UserError) as caught:
        load_weights(str(tmp_path / "edited.pt"), "MODEL")
    assert_names(str(caught.value), tmp_path / "edited.pt", culprit)
    assert "--model" not in str(caught.value)


def test_a_folder_named_as_a_checkpoint_is_said_to_be_a_folder(tmp_path):
    from imagenet_elastic.models.weights import load_weights

    (tmp_path / "last.pt").mkdir()
    with pytest.raises(UserError) as caught:
        load_weights(str(tmp_path / "last.pt"), "MODEL")
    assert_names(str(caught.value), tmp_path / "last.pt", "folder")


def test_a_timm_training_checkpoint_with_its_args_loads(tmp_path):
    source = source_model(4)
    args = argparse.Namespace(model="test_resnet", lr=0.1, epochs=3)  # timm's train.py saves these beside the weights
    torch.save({"epoch": 3, "arch": "test_resnet", "state_dict": source.state_dict(), "args": args},
               tmp_path / "model_best.pth.tar")
    model = fresh(4)
    InitialWeights.read(str(tmp_path / "model_best.pth.tar")).load(model, "model_best.pth.tar", "test_resnet")
    assert_loaded_except_the_head(model, source, head_refit=False)


def test_a_whole_pickled_model_is_refused_naming_the_class_it_would_import(tmp_path):
    torch.save(source_model(4), tmp_path / "whole.pth")
    with pytest.raises(UserError) as caught:
        InitialWeights.read(str(tmp_path / "whole.pth"))
    assert_names(str(caught.value), f"--initial-checkpoint {tmp_path / 'whole.pth'}", "Unsupported global")
    assert "\x1b" not in str(caught.value)  # torch's advice comes with terminal colours


def test_the_folders_teacher_takes_give_their_weights_and_any_other_folder_is_one_line_saying_what_it_takes(tmp_path):
    """A run's checkpoints folder (its best.pt) and an export folder, as --teacher and `evaluate` take them."""
    from imagenet_elastic.tools.export import export

    (tmp_path / "run").mkdir()
    snapshot = our_checkpoint(tmp_path / "run" / "best.pt")
    export(str(tmp_path / "run" / "best.pt"), str(tmp_path / "export"), ema=False)
    for folder in ("run", "export"):
        weights = InitialWeights.read(str(tmp_path / folder))
        assert (weights.classes, weights.blurpool) == (("a", "b", "c"), False), folder
        assert weights.tensors.keys() == snapshot["model"].keys()
        assert all(torch.equal(weights.tensors[k], v) for k, v in snapshot["model"].items()), folder
    (tmp_path / "other").mkdir()
    with pytest.raises(UserError) as caught:
        InitialWeights.read(str(tmp_path / "other"))
    assert_names(str(caught.value), "--initial-checkpoint", tmp_path / "other", "config.json", "best.pt")
