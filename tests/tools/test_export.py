"""`imagenet-elastic export`: timm rebuilds the exported model with the checkpoint's weights, class names
and preprocessing, and timm's own evaluation pipeline scores it as our validation did."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys

import pytest
import safetensors.torch
import timm
import torch
from conftest import assert_names, child_env
from safetensors import SafetensorError
from safetensors.torch import load_file
from timm.data import create_transform, resolve_data_config
from torchvision.datasets import ImageFolder

from imagenet_elastic.errors import STORAGE_ERROR_EXIT, UserError
from imagenet_elastic.models.create import create_model
from imagenet_elastic.report.metrics import read as read_metrics
from imagenet_elastic.tools.export import crop_fraction, main, write_folder

CLASSES = ["cat", "dog", "eel"]


def write_checkpoint(path, ema: bool = True) -> dict:
    torch.manual_seed(0)
    raw, averaged = create_model("test_resnet", 3), create_model("test_resnet", 3)
    snapshot = {"model": raw.state_dict(), "model_ema": averaged.state_dict() if ema else None, "epoch": 7,
                "model_name": "test_resnet", "classes": CLASSES, "best_of": "model_ema" if ema else "model",
                "config": {"image_size": 160, "val_crop_size": None, "val_resize": None}, "optimizer": {}}
    torch.save(snapshot, path)
    return snapshot


def test_the_export_holds_the_weights_class_names_and_preprocessing_and_timm_rebuilds_it(tmp_path, capsys):
    saved = write_checkpoint(tmp_path / "best.pt")
    out = tmp_path / "export"
    main([str(tmp_path / "best.pt"), str(out)])
    said = capsys.readouterr().out
    assert "raw weights of epoch 7; its weight average scored best: add --ema" in said
    assert f'timm.create_model("local-dir:{out}", pretrained=True)' in said
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    weights = load_file(out / "model.safetensors")
    assert weights.keys() == saved["model"].keys()
    assert all(torch.equal(weights[k], saved["model"][k]) for k in weights)
    config = json.loads((out / "config.json").read_text())
    assert (config["architecture"], config["num_classes"], config["label_names"]) == ("test_resnet", 3, CLASSES)
    cfg = config["pretrained_cfg"]
    assert cfg["input_size"] == [3, 160, 160] and cfg["interpolation"] == "bilinear" and cfg["crop_mode"] == "center"
    assert math.floor(160 / cfg["crop_pct"]) == 183  # resize 183 = round(160 / 0.875), as our validation
    assert cfg["mean"] == pytest.approx([0.485, 0.456, 0.406]) and cfg["std"] == pytest.approx([0.229, 0.224, 0.225])
    model = timm.create_model(f"local-dir:{out}", pretrained=True)
    assert model.num_classes == 3 and model.pretrained_cfg["label_names"] == CLASSES
    assert all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
    data = resolve_data_config({}, model=model)
    assert (data["input_size"], data["crop_pct"], data["interpolation"]) == ((3, 160, 160), cfg["crop_pct"],
                                                                           "bilinear")


def test_ema_exports_the_weight_average(tmp_path, capsys):
    saved = write_checkpoint(tmp_path / "best.pt")
    main([str(tmp_path / "best.pt"), str(tmp_path / "ema"), "--ema"])
    assert "weight average of epoch 7" in capsys.readouterr().out
    weights = load_file(tmp_path / "ema" / "model.safetensors")
    assert all(torch.equal(weights[k], saved["model_ema"][k]) for k in weights)
    assert not all(torch.equal(weights[k], saved["model"][k]) for k in weights)


@pytest.mark.parametrize("crop, resize", [(224, 256), (32, 37), (176, 232), (160, 183), (288, 329), (7, 9)])
def test_timm_computes_our_resize_back_from_the_crop_fraction(crop, resize):
    assert math.floor(crop / crop_fraction(crop, resize)) == resize


def one_line_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as stop:
        main(list(argv))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_user_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    assert "checkpoint " in one_line_error(capsys, str(tmp_path / "missing.pt"), str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    write_checkpoint(tmp_path / "plain.pt", ema=False)
    said = one_line_error(capsys, str(tmp_path / "plain.pt"), str(tmp_path / "b"), "--ema")
    assert "has no weight average (it was trained without --model-ema)" in said and not (tmp_path / "b").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert "is not empty" in one_line_error(capsys, str(tmp_path / "plain.pt"), str(tmp_path / "full"))
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("out", ["", "file", "file/sub"])
def test_an_out_dir_that_is_empty_a_file_or_under_one_is_bad_input_naming_it_before_writing(tmp_path, capsys, out):
    write_checkpoint(tmp_path / "plain.pt", ema=False)
    (tmp_path / "file").write_text("mine")
    out_dir = str(tmp_path / out) if out else ""
    assert_names(one_line_error(capsys, str(tmp_path / "plain.pt"), out_dir), out_dir or "OUT_DIR")
    assert (tmp_path / "file").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["file", "plain.pt"]


def failing_writer(error: BaseException):
    """A writer that starts its file, then fails as a full disk makes it."""
    def write(tensors, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half")
        raise error
    return write


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   SafetensorError("Error while serializing: I/O error: No space left on device (os "
                                                   "error 28)")], ids=["OSError", "SafetensorError"])
@pytest.mark.parametrize("made", [False, True], ids=["new", "empty"])
def test_a_full_disk_is_one_line_naming_out_and_leaves_out_as_it_was(tmp_path, capsys, monkeypatch, error, made):
    """An OUT_DIR the user made, empty, stays so; one export made is not left behind; nor is any temp folder."""
    write_checkpoint(tmp_path / "best.pt")
    out = tmp_path / "export"
    if made:
        out.mkdir()
    monkeypatch.setattr(safetensors.torch, "save_file", failing_writer(error))
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "best.pt"), str(out)])
    assert stop.value.code == STORAGE_ERROR_EXIT
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert_names(err, out, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "export"] if made else ["best.pt"]
    assert not made or not any(out.iterdir())


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["OSError", "Ctrl-C"])
def test_a_failed_export_removes_the_parent_folders_it_made_and_only_those(tmp_path, error):
    (tmp_path / "kept" / "other").mkdir(parents=True)
    out = tmp_path / "kept" / "new" / "deeper" / "export"

    def write(folder: str) -> None:
        (tmp_path / "kept" / "other" / "theirs").write_text("x")  # another's, meanwhile, beside them
        raise error

    with pytest.raises((UserError, KeyboardInterrupt)):
        write_folder(str(out), write)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["other"]
    assert (tmp_path / "kept" / "other" / "theirs").read_text() == "x"


def test_an_empty_out_that_is_a_mount_point_is_filled_without_crossing_file_systems(tmp_path, capsys, monkeypatch):
    """OUT_DIR a mount point: a file moved into it from outside (its parent) fails with EXDEV, as the OS does."""
    write_checkpoint(tmp_path / "best.pt")
    out = tmp_path / "export"
    out.mkdir()
    real_replace = os.replace

    def replace_on_one_file_system(src, dst, *args, **kwargs):
        if os.path.commonpath([out, src]) != str(out) and os.path.commonpath([out, dst]) == str(out):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace_on_one_file_system)
    main([str(tmp_path / "best.pt"), str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "export"]


def test_checkpoint_folders_are_read_as_evaluate_reads_them(tmp_path, capsys):
    """A run's checkpoints folder is its best.pt; a folder without one is said to be a folder, not missing."""
    saved = write_checkpoint(tmp_path / "best.pt")
    main([str(tmp_path), str(tmp_path / "export")])
    weights = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(weights[k], saved["model"][k]) for k in weights)
    (tmp_path / "last.pt").mkdir()
    said = one_line_error(capsys, str(tmp_path / "last.pt"), str(tmp_path / "other"))
    assert_names(said, tmp_path / "last.pt", "folder", "best.pt")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("edit, culprit", [
    (lambda s: s.update(model=create_model("test_vit_distilled", 3).state_dict()), "'model' weights"),
    (lambda s: s["model"].update({"fc.weight": torch.zeros(1)}), "fc.weight"),
    (lambda s: s.pop("classes"), "classes"),
    (lambda s: s.pop("model_name"), "model_name"),
    (lambda s: s.update(model_name="no_such_net"), "'no_such_net'"),
], ids=["other_model", "other_shape", "no_classes", "no_model_name", "unknown_model"])
def test_a_foreign_or_hand_edited_checkpoint_is_one_line_naming_it_and_what_is_wrong(tmp_path, capsys, edit, culprit):
    snapshot = write_checkpoint(tmp_path / "best.pt")
    edit(snapshot)
    torch.save(snapshot, tmp_path / "edited.pt")
    said = one_line_error(capsys, str(tmp_path / "edited.pt"), str(tmp_path / "export"))
    assert_names(said, tmp_path / "edited.pt", culprit)
    assert "--model" not in said and not (tmp_path / "export").exists()


@pytest.mark.slow  # a fresh interpreter, whose timm knows only its own models
def test_the_load_line_printed_for_a_tiny_distilled_vit_runs_as_printed_in_plain_python_offline(tmp_path, capsys):
    """test_vit_distilled is ours (tiny_models.py): timm alone does not know the name the export's config.json
    gives."""
    torch.manual_seed(0)
    model = create_model("test_vit_distilled", 3)
    torch.save({"model": model.state_dict(), "model_ema": None, "epoch": 1, "model_name": "test_vit_distilled",
                "classes": CLASSES, "best_of": "model", "config": {"image_size": 32}, "optimizer": {}},
               tmp_path / "best.pt")
    main([str(tmp_path / "best.pt"), str(tmp_path / "export")])
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("load it: "))
    code = printed.removeprefix("load it: ") + "\nprint(type(model).__name__, model.num_classes)"
    ran = subprocess.run([sys.executable, "-c", code], env=child_env(HF_HUB_OFFLINE="1"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["VisionTransformerDistilled", "3"]


@pytest.mark.slow  # takes the trained 2-process reference run
@pytest.mark.multiprocess
def test_timm_evaluating_the_export_its_own_way_scores_what_our_validation_recorded(torchrun_reference, image_folder,
                                                                                    tmp_path):
    ckpt, _ = torchrun_reference
    main([str(ckpt / "last.pt"), str(tmp_path / "export")])
    model = timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True).eval()
    transform = create_transform(**resolve_data_config({}, model=model))  # timm's eval pipeline, as validate.py
    val = ImageFolder(str(image_folder / "val"), transform=transform)
    assert val.classes == model.pretrained_cfg["label_names"]
    loader = torch.utils.data.DataLoader(val, batch_size=64)
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in loader)
    ours = read_metrics(ckpt / "metrics.jsonl")[-1]["val_top1"]
    theirs = 100.0 * correct / len(val)
    print(f"val top-1 on {len(val)} images: ours {ours:.2f}, timm's pipeline {theirs:.2f}")
    # Our validation computes timm's pixels within a level (tests/data/test_reference_pixels.py), in fp32 here: the same
    # predictions, so the same count.
    assert theirs == pytest.approx(ours), (ours, theirs)
